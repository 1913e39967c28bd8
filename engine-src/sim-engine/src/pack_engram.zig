//! python3: runs one script, pack_engram.py (the Engram packer of the TensorFold Python lanes).
//!
//!   python3 .../pack_engram.py --src DIR --config FILE --out DIR --rank N [--tp W]
//!   python3 .../pack_engram.py [--src DIR --config FILE] --check DIR --rank N [--tp W]
//!
//! Packing writes engram-l1-r<N>of<W>.bin and engram-l14-r<N>of<W>.bin to --out, deterministic from
//! the files under --src (common.digestTree) and the --config bytes (temp name, then rename). W is
//! --tp, else WORLD_SIZE from the environment, else 2 (the lane's derivation passes no --tp).
//! --check verifies both files of rank N: their header and payload digest, and, when --src and
//! --config are given, that they were packed from those. Any other script exits 2.
const std = @import("std");
const common = @import("common.zig");

const Ctx = common.Ctx;
const eql = common.eql;
const Sha256 = std.crypto.hash.sha2.Sha256;

pub const usage = "usage: pack_engram.py [--src DIR] [--config FILE] (--out DIR | --check DIR) --rank N [--tp W]";
const payload_len = 4096;
const layers = [_]u32{ 1, 14 };

pub fn main(ctx: *const Ctx, argv: []const []const u8) noreturn {
    if (argv.len >= 1 and (eql(argv[0], "--version") or eql(argv[0], "-V"))) {
        ctx.out("Python 3 (sim-engine {s} simulator: runs pack_engram.py only)", .{common.version});
        std.process.exit(0);
    }
    if (argv.len == 0 or common.isFlag(argv[0])) {
        ctx.usageError("python3 (simulator): runs a script, and only pack_engram.py: python3 .../pack_engram.py ARGS", .{});
    }
    const script = argv[0];
    if (!eql(std.fs.path.basename(script), "pack_engram.py")) {
        ctx.usageError("python3 (simulator): {s}: only pack_engram.py is simulated", .{script});
    }
    if (common.kindOf(ctx.io, script) != .file) {
        ctx.usageError("python3: can't open file '{s}': [Errno 2] No such file or directory", .{script});
    }
    var script_ctx = ctx.*;
    script_ctx.name = "pack_engram.py";
    packEngram(&script_ctx, argv[1..]);
}

fn packEngram(ctx: *const Ctx, argv: []const []const u8) noreturn {
    var src: ?[]const u8 = null;
    var config: ?[]const u8 = null;
    var out_dir: ?[]const u8 = null;
    var check: ?[]const u8 = null;
    var rank_s: ?[]const u8 = null;
    var tp_s: ?[]const u8 = null;
    var unknown: std.ArrayList(u8) = .empty;
    var a = common.Args.init(argv);
    while (a.next()) |tok| {
        const slot: ?*?[]const u8 = if (eql(tok, "--src")) &src //
            else if (eql(tok, "--config")) &config //
            else if (eql(tok, "--out")) &out_dir //
            else if (eql(tok, "--check")) &check //
            else if (eql(tok, "--rank")) &rank_s //
            else if (eql(tok, "--tp")) &tp_s //
            else null;
        if (slot) |s| {
            s.* = a.value() orelse ctx.usageError("{s}\npack_engram.py: error: argument {s}: expected one argument", .{ usage, tok });
            continue;
        }
        if (unknown.items.len > 0) unknown.append(ctx.arena, ' ') catch common.oom(ctx);
        unknown.appendSlice(ctx.arena, a.items[a.i - 1]) catch common.oom(ctx);
    }
    if (unknown.items.len > 0) ctx.usageError("{s}\npack_engram.py: error: unrecognized arguments: {s}", .{ usage, unknown.items });
    const rank_text = rank_s orelse ctx.usageError("{s}\npack_engram.py: error: the following arguments are required: --rank", .{usage});
    const rank = std.fmt.parseInt(u32, rank_text, 10) catch
        ctx.usageError("{s}\npack_engram.py: error: argument --rank: invalid int value: '{s}'", .{ usage, rank_text });
    if ((check == null) == (out_dir == null)) ctx.usageError("{s}\npack_engram.py: error: give one of --out and --check", .{usage});
    var world: ?u32 = null;
    if (tp_s orelse ctx.env.get("WORLD_SIZE")) |t| {
        world = std.fmt.parseInt(u32, t, 10) catch ctx.usageError("{s}\npack_engram.py: error: --tp: invalid int value: '{s}'", .{ usage, t });
    }

    var src_hex: ?[64]u8 = null;
    var config_hex: ?[64]u8 = null;
    if (src) |s| {
        common.requireDir(ctx, "--src", s);
        ctx.log("hashing {s}", .{s});
        src_hex = common.digestTree(ctx, "--src", s).hex();
    }
    if (config) |c| {
        common.requireFile(ctx, "--config", c);
        const bytes = std.Io.Dir.cwd().readFileAlloc(ctx.io, c, ctx.arena, .limited(1 << 30)) catch |e|
            ctx.refuse("--config: cannot read {s}: {t}", .{ c, e });
        config_hex = common.sha256Hex(bytes);
    }

    if (out_dir) |out| {
        if (src_hex == null) ctx.usageError("{s}\npack_engram.py: error: packing needs --src", .{usage});
        if (config_hex == null) ctx.usageError("{s}\npack_engram.py: error: packing needs --config", .{usage});
        const w = world orelse 2;
        if (w == 0 or rank >= w) ctx.refuse("rank {d} is not in a world of {d}", .{ rank, w });
        for (layers) |layer| {
            const name = fileName(ctx, layer, rank, w);
            common.writeAtomic(ctx, out, name, pack(ctx, layer, rank, w, &src_hex.?, &config_hex.?));
            ctx.out("{s}", .{common.pathJoin(ctx, out, name)});
        }
        ctx.log("packed rank {d} of {d} from {s} into {s}", .{ rank, w, src.?, out });
        std.process.exit(0);
    }

    const dir = check.?;
    common.requireDir(ctx, "--check", dir);
    const w = world orelse inferWorld(ctx, dir, rank);
    var bad: usize = 0;
    for (layers) |layer| {
        const name = fileName(ctx, layer, rank, w);
        const full = common.pathJoin(ctx, dir, name);
        if (verify(ctx, full, layer, rank, w, if (src_hex) |*h| h else null, if (config_hex) |*h| h else null)) |why| {
            ctx.log("{s}: {s}", .{ full, why });
            bad += 1;
        } else {
            ctx.out("{s}: ok", .{full});
        }
    }
    if (bad > 0) ctx.refuse("check failed: {d} of {d} files of rank {d} of {d}", .{ bad, layers.len, rank, w });
    ctx.log("check ok: rank {d} of {d} in {s}", .{ rank, w, dir });
    std.process.exit(0);
}

fn fileName(ctx: *const Ctx, layer: u32, rank: u32, world: u32) []const u8 {
    return std.fmt.allocPrint(ctx.arena, "engram-l{d}-r{d}of{d}.bin", .{ layer, rank, world }) catch common.oom(ctx);
}

fn pack(ctx: *const Ctx, layer: u32, rank: u32, world: u32, src_hex: *const [64]u8, config_hex: *const [64]u8) []const u8 {
    var h = Sha256.init(.{});
    h.update(src_hex);
    h.update(config_hex);
    const tail = std.fmt.allocPrint(ctx.arena, "\x00layer={d}\x00rank={d}\x00world={d}", .{ layer, rank, world }) catch common.oom(ctx);
    h.update(tail);
    const seed = std.fmt.bytesToHex(h.finalResult(), .lower);
    const body = common.payload(ctx, &seed, payload_len);
    return std.fmt.allocPrint(ctx.arena,
        \\TFSIM-ENGRAM 1
        \\layer {d}
        \\rank {d}
        \\world {d}
        \\src-sha256 {s}
        \\config-sha256 {s}
        \\payload-sha256 {s}
        \\
        \\{s}
    , .{ layer, rank, world, src_hex, config_hex, &common.sha256Hex(body), body }) catch common.oom(ctx);
}

/// Null when the file is good; else why not.
fn verify(ctx: *const Ctx, full: []const u8, layer: u32, rank: u32, world: u32, src_hex: ?*const [64]u8, config_hex: ?*const [64]u8) ?[]const u8 {
    const data = std.Io.Dir.cwd().readFileAlloc(ctx.io, full, ctx.arena, .limited(64 << 20)) catch |e|
        return std.fmt.allocPrint(ctx.arena, "cannot read: {t}", .{e}) catch "cannot read";
    const h = common.parseHeader(data) orelse return "not an Engram pack, or damaged (payload digest)";
    if (!eql(h.kind, "ENGRAM")) return "not an Engram pack";
    var buf: [3][12]u8 = undefined;
    const want = [_][2][]const u8{
        .{ "layer", std.fmt.bufPrint(&buf[0], "{d}", .{layer}) catch unreachable },
        .{ "rank", std.fmt.bufPrint(&buf[1], "{d}", .{rank}) catch unreachable },
        .{ "world", std.fmt.bufPrint(&buf[2], "{d}", .{world}) catch unreachable },
    };
    for (want) |kv| {
        const got = h.get(kv[0]) orelse "";
        if (!eql(got, kv[1])) return std.fmt.allocPrint(ctx.arena, "{s} is '{s}', expected {s}", .{ kv[0], got, kv[1] }) catch "bad header";
    }
    if (src_hex) |s| if (!eql(h.get("src-sha256") orelse "", s)) return "packed from other --src files";
    if (config_hex) |c| if (!eql(h.get("config-sha256") orelse "", c)) return "packed with another --config";
    return null;
}

/// The world of rank N's files in dir, when --tp is not given.
fn inferWorld(ctx: *const Ctx, dir: []const u8, rank: u32) u32 {
    var found: ?u32 = null;
    for (common.listDir(ctx, "--check", dir)) |name| {
        const p = common.parseEngramName(name) orelse continue;
        if (p.rank != rank) continue;
        if (found) |f| if (f != p.world) ctx.refuse("{s} holds rank {d} files for worlds {d} and {d}: give --tp", .{ dir, rank, f, p.world });
        found = p.world;
    }
    return found orelse ctx.refuse("no engram-l*-r{d}of*.bin in {s}", .{ rank, dir });
}
