//! tf-dsv41-rank-cache: one rank's weight file, made on the host with no GPU.
//!
//!   tf-dsv41-rank-cache MODEL OUT_DIR G WORLD [--parity] [--token-map FILE]
//!
//! Writes OUT_DIR/rank<G>of<WORLD>-<20 hex>.bin: the 20 hex are the start of the SHA-256 of the
//! model's files (common.digestTree) followed by G, WORLD (and "parity" with --parity), so the same
//! model gives the same name and bytes and another rank another file. An older rank<G>of<WORLD>-*.bin
//! in OUT_DIR is removed (the engines take exactly one). With --token-map FILE it also writes a token
//! map from MODEL/tokenizer.json (config.json when there is none). Writes go to a temp name first.
const std = @import("std");
const common = @import("common.zig");

const Ctx = common.Ctx;
const eql = common.eql;

pub const usage = "usage: tf-dsv41-rank-cache MODEL OUT_DIR G WORLD [--parity] [--token-map FILE]";

/// The size of the simulated weights in each rank file.
const payload_len = 4096;

pub fn main(ctx: *const Ctx, argv: []const []const u8) noreturn {
    if (argv.len == 1 and eql(argv[0], "--version")) {
        ctx.out("tf-dsv41-rank-cache {s} (simulator)", .{common.version});
        std.process.exit(0);
    }
    var pos: [4][]const u8 = undefined;
    var npos: usize = 0;
    var parity = false;
    var token_map: ?[]const u8 = null;
    var a = common.Args.init(argv);
    while (a.next()) |tok| {
        if (eql(tok, "--parity") and a.inline_value == null) {
            parity = true;
            continue;
        }
        if (eql(tok, "--token-map")) {
            token_map = a.value() orelse ctx.usageError("error: missing value for '--token-map'", .{});
            continue;
        }
        if (common.isFlag(tok) or npos == pos.len) ctx.usageError("error: unknown argument '{s}'\n{s}", .{ tok, usage });
        pos[npos] = tok;
        npos += 1;
    }
    if (npos < pos.len) ctx.usageError("error: expected 4 arguments, got {d}\n{s}", .{ npos, usage });
    const model = pos[0];
    const out_dir = pos[1];
    const rank = std.fmt.parseInt(u32, pos[2], 10) catch ctx.usageError("error: G: not a number: '{s}'", .{pos[2]});
    const world = std.fmt.parseInt(u32, pos[3], 10) catch ctx.usageError("error: WORLD: not a number: '{s}'", .{pos[3]});
    if (world == 0 or rank >= world) ctx.refuse("rank {d} is not in a world of {d}", .{ rank, world });
    common.requireModel(ctx, model);

    ctx.log("rank {d} of {d}: hashing {s}", .{ rank, world, model });
    const d = common.digestTree(ctx, "model", model);
    const model_hex = d.hex();

    // The file's name and seed: the model digest, then the rank, the world and the options.
    const Sha256 = std.crypto.hash.sha2.Sha256;
    var h = Sha256.init(.{});
    h.update(&d.sha256);
    const tail = std.fmt.allocPrint(ctx.arena, "\x00rank={d}\x00world={d}{s}", .{ rank, world, if (parity) "\x00parity" else "" }) catch common.oom(ctx);
    h.update(tail);
    const id = std.fmt.bytesToHex(h.finalResult(), .lower);
    const name = std.fmt.allocPrint(ctx.arena, "rank{d}of{d}-{s}.bin", .{ rank, world, id[0..20] }) catch common.oom(ctx);

    const body = common.payload(ctx, &id, payload_len);
    const data = std.fmt.allocPrint(ctx.arena,
        \\TFSIM-RANKCACHE 1
        \\rank {d}
        \\world {d}
        \\parity {d}
        \\model-sha256 {s}
        \\model-files {d}
        \\payload-sha256 {s}
        \\
        \\{s}
    , .{ rank, world, @intFromBool(parity), &model_hex, d.files, &common.sha256Hex(body), body }) catch common.oom(ctx);
    common.writeAtomic(ctx, out_dir, name, data);
    // The engines take exactly one file per rank: drop this rank's files from an older model.
    for (common.listDir(ctx, "OUT_DIR", out_dir)) |other| {
        const p = common.parseRankCacheName(other) orelse continue;
        if (p.rank == rank and p.world == world and !eql(other, name)) {
            common.deleteIn(ctx, out_dir, other);
            ctx.log("removed {s}/{s} (an older rank {d} file)", .{ out_dir, other, rank });
        }
    }
    const full = common.pathJoin(ctx, out_dir, name);
    ctx.log("wrote {s} ({d} model files, {d} bytes, model sha256 {s})", .{ full, d.files, d.bytes, &model_hex });
    ctx.out("{s}", .{full});

    if (token_map) |tm| {
        const tok_path = common.pathJoin(ctx, model, "tokenizer.json");
        const src_name = if (common.kindOf(ctx.io, tok_path) == .file) "tokenizer.json" else "config.json";
        const src = common.pathJoin(ctx, model, src_name);
        const bytes = std.Io.Dir.cwd().readFileAlloc(ctx.io, src, ctx.arena, .limited(1 << 30)) catch |e|
            ctx.refuse("--token-map: cannot read {s}: {t}", .{ src, e });
        const json = std.json.Stringify.valueAlloc(ctx.arena, .{
            .format = "tf-dsv41-token-map (simulator) 1",
            .source = src_name,
            .source_sha256 = &common.sha256Hex(bytes),
            .source_bytes = bytes.len,
        }, .{}) catch common.oom(ctx);
        const dir = std.fs.path.dirname(tm) orelse ".";
        const line = std.fmt.allocPrint(ctx.arena, "{s}\n", .{json}) catch common.oom(ctx);
        common.writeAtomic(ctx, dir, std.fs.path.basename(tm), line);
        ctx.log("wrote {s} (from {s})", .{ tm, src_name });
        ctx.out("{s}", .{tm});
    }
    std.process.exit(0);
}
