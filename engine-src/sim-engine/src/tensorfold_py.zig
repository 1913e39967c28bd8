//! tensorfold: TensorFold's Python engine (tensorfold-python-tp2), every rank.
//!
//!   tensorfold serve MODEL --host H --port P --parallel K
//!   env: RANK WORLD_SIZE MASTER_ADDR MASTER_PORT TF_DSV41_BIAS_VL
//!
//! Rank 0 opens the store on MASTER_PORT (all addresses) at once and serves the API on host:port,
//! /health ok once WORLD_SIZE-1 ranks have joined. A rank >= 1 connects to MASTER_ADDR:MASTER_PORT,
//! retrying for at most TF_SIM_STORE_TIMEOUT seconds (default 10), then fails as torch's store does:
//! "DistStoreError: Timed out after N seconds waiting for clients. 1/W clients joined." That is why
//! the lane starts rank 0 first.
//!
//! When /engram is a folder (TF_SIM_ENGRAM_DIR names another, for tests) it must hold this rank's
//! engram-l1-r<rank>of<W>.bin and engram-l14-r<rank>of<W>.bin and no other rank's file.
//!
//! /v1/models lists MODEL; when the container has builder's launch file ($BUILDER_CONFIG) it lists
//! that file's serve.served_name first (see laneServedName).
const std = @import("std");
const common = @import("common.zig");
const rendezvous = @import("rendezvous.zig");
const api = @import("api.zig");

const Ctx = common.Ctx;
const eql = common.eql;

pub const usage = "usage: tensorfold serve MODEL [--host HOST] [--port PORT] [--parallel N]";

pub fn main(ctx: *const Ctx, argv: []const []const u8) noreturn {
    if (argv.len >= 1 and (eql(argv[0], "--version") or eql(argv[0], "version"))) {
        ctx.out("tensorfold {s} (simulator)", .{common.version});
        std.process.exit(0);
    }
    if (argv.len == 0 or !eql(argv[0], "serve")) {
        ctx.usageError("{s}\ntensorfold: error: argument command: invalid choice: '{s}' (choose from 'serve')", .{ usage, if (argv.len == 0) "" else argv[0] });
    }
    var model: ?[]const u8 = null;
    var host: []const u8 = "0.0.0.0";
    var port: u16 = 8000;
    var parallel: u32 = 1;
    var unknown: std.ArrayList(u8) = .empty;
    var a = common.Args.init(argv[1..]);
    while (a.next()) |tok| {
        if (common.oneOf(tok, &.{ "--host", "--port", "--parallel" })) {
            const v = a.value() orelse ctx.usageError("{s}\ntensorfold: error: argument {s}: expected one argument", .{ usage, tok });
            if (eql(tok, "--host")) {
                host = v;
            } else if (eql(tok, "--port")) {
                port = std.fmt.parseInt(u16, v, 10) catch ctx.usageError("{s}\ntensorfold: error: argument --port: invalid int value: '{s}'", .{ usage, v });
            } else {
                parallel = std.fmt.parseInt(u32, v, 10) catch ctx.usageError("{s}\ntensorfold: error: argument --parallel: invalid int value: '{s}'", .{ usage, v });
            }
            continue;
        }
        if (!common.isFlag(tok) and model == null) {
            model = tok;
            continue;
        }
        if (unknown.items.len > 0) unknown.append(ctx.arena, ' ') catch common.oom(ctx);
        unknown.appendSlice(ctx.arena, a.items[a.i - 1]) catch common.oom(ctx);
    }
    if (unknown.items.len > 0) ctx.usageError("{s}\ntensorfold: error: unrecognized arguments: {s}", .{ usage, unknown.items });
    const model_dir = model orelse ctx.usageError("{s}\ntensorfold: error: the following arguments are required: model", .{usage});

    const rank_s = ctx.requireEnv("RANK");
    const world_s = ctx.requireEnv("WORLD_SIZE");
    const master = ctx.requireEnv("MASTER_ADDR");
    const mport_s = ctx.requireEnv("MASTER_PORT");
    const bias = ctx.requireEnv("TF_DSV41_BIAS_VL");
    const rank = ctx.envInt(u32, "RANK", rank_s);
    const world = ctx.envInt(u32, "WORLD_SIZE", world_s);
    const mport = ctx.envInt(u16, "MASTER_PORT", mport_s);
    if (world == 0 or rank >= world) ctx.refuse("RANK {d} is not in WORLD_SIZE {d}", .{ rank, world });

    common.requireModel(ctx, model_dir);
    if (common.kindOf(ctx.io, bias) == .missing) ctx.refuse("TF_DSV41_BIAS_VL: {s} not found", .{bias});
    const engram_dir = ctx.env.get("TF_SIM_ENGRAM_DIR") orelse "/engram";
    const engram_note = if (common.kindOf(ctx.io, engram_dir) == .directory) checkEngram(ctx, engram_dir, rank, world) else "no Engram folder";

    if (rank == 0) {
        ctx.log("rank 0 of {d}: store listening on 0.0.0.0:{d}; serving {s} on {s}:{d} (parallel {d}, {s})", .{
            world, mport, model_dir, host, port, parallel, engram_note,
        });
        const reg = rendezvous.startHead(ctx, .tensorfold_python, world, mport);
        const the_api = ctx.arena.create(api.Api) catch common.oom(ctx);
        the_api.* = .{ .served_name = model_dir, .owned_by = "tensorfold (simulator)", .registry = reg };
        if (laneServedName(ctx)) |name| {
            if (!eql(name, model_dir)) {
                ctx.log("the real engine's served-name flag is UNKNOWN: listing the lane's served name '{s}' (from $BUILDER_CONFIG) and {s}", .{ name, model_dir });
                const more = ctx.arena.alloc([]const u8, 1) catch common.oom(ctx);
                more[0] = model_dir;
                the_api.served_name = name;
                the_api.also_listed = more;
            }
        }
        api.serve(ctx, host, port, the_api);
    }
    const timeout_s: u32 = if (ctx.env.get("TF_SIM_STORE_TIMEOUT")) |t|
        std.fmt.parseInt(u32, t, 10) catch ctx.refuse("TF_SIM_STORE_TIMEOUT: not a number: '{s}'", .{t})
    else
        10;
    ctx.log("rank {d} of {d}: connecting to the store at {s}:{d} (timeout {d}s, {s})", .{ rank, world, master, mport, timeout_s, engram_note });
    switch (rendezvous.follow(ctx, .tensorfold_python, master, mport, rank, world, .{ .timeout_s = timeout_s, .what = "store" })) {
        .timed_out => {
            ctx.plain("torch.distributed.DistStoreError: Timed out after {d} seconds waiting for clients. 1/{d} clients joined.", .{ timeout_s, world });
            std.process.exit(1);
        },
    }
}

/// This rank's two Engram packs, and no other rank's. Returns a note for the start line.
fn checkEngram(ctx: *const Ctx, dir: []const u8, rank: u32, world: u32) []const u8 {
    var have_l1 = false;
    var have_l14 = false;
    for (common.listDir(ctx, "engram", dir)) |name| {
        const p = common.parseEngramName(name) orelse continue;
        if (p.rank != rank) ctx.refuse("engram: {s} is rank {d}'s, this is rank {d}", .{ name, p.rank, rank });
        if (p.world != world) ctx.refuse("engram: {s} is for a world of {d}, this is a world of {d}", .{ name, p.world, world });
        if (p.layer == 1) have_l1 = true;
        if (p.layer == 14) have_l14 = true;
    }
    if (!have_l1) ctx.refuse("engram: no engram-l1-r{d}of{d}.bin in {s} (run pack_engram.py)", .{ rank, world, dir });
    if (!have_l14) ctx.refuse("engram: no engram-l14-r{d}of{d}.bin in {s} (run pack_engram.py)", .{ rank, world, dir });
    return std.fmt.allocPrint(ctx.arena, "Engram from {s}", .{dir}) catch common.oom(ctx);
}

/// serve.served_name of the builder launch file the container is given ($BUILDER_CONFIG), if any.
/// A simulator convenience: TensorFold's Python engine takes no name flag that is known, so without
/// it /v1/models could only list MODEL and the lane's serving checks could not pass.
fn laneServedName(ctx: *const Ctx) ?[]const u8 {
    const path = ctx.env.get("BUILDER_CONFIG") orelse return null;
    const data = std.Io.Dir.cwd().readFileAlloc(ctx.io, path, ctx.arena, .limited(1 << 20)) catch return null;
    const root = std.json.parseFromSliceLeaky(std.json.Value, ctx.arena, data, .{}) catch return null;
    if (root != .object) return null;
    const serve = root.object.get("serve") orelse return null;
    if (serve != .object) return null;
    const name = serve.object.get("served_name") orelse return null;
    if (name != .string or name.string.len == 0) return null;
    return name.string;
}
