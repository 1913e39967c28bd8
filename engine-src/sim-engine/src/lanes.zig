//! tf-dsv41-lanes: the followers (ranks >= 1) of the Zig TensorFold lanes.
//!
//!   tf-dsv41-lanes MODEL RANK_CACHE G WORLD MASTER PORT KIT [--pool N] [--engram DIR]
//!       [--token-map FILE] [--rdma DEVS] [--rdma-kernels FILE] [--graphs N] [--side N]
//!       [--prefetch N] [--aio N] [--round-rows N] [--streams N] [--context N]
//!
//! Flags may repeat; the last wins (node_run.sh passes --pool twice). After its checks it dials
//! MASTER:PORT every second until the head answers, joins, and holds the connection; it exits 1
//! when the head goes away. It opens no port.
const std = @import("std");
const common = @import("common.zig");
const rendezvous = @import("rendezvous.zig");

const Ctx = common.Ctx;
const eql = common.eql;

pub const usage =
    \\usage: tf-dsv41-lanes MODEL RANK_CACHE G WORLD MASTER PORT KIT [--pool N] [--engram DIR]
    \\         [--token-map FILE] [--rdma DEVS] [--rdma-kernels FILE] [--graphs N] [--side N]
    \\         [--prefetch N] [--aio N] [--round-rows N] [--streams N] [--context N]
;

const numeric_flags = [_][]const u8{ "--pool", "--graphs", "--side", "--prefetch", "--aio", "--round-rows", "--streams", "--context" };
const path_flags = [_][]const u8{ "--engram", "--token-map", "--rdma", "--rdma-kernels" };

pub fn main(ctx: *const Ctx, argv: []const []const u8) noreturn {
    if (argv.len == 1 and eql(argv[0], "--version")) {
        ctx.out("tf-dsv41-lanes {s} (simulator)", .{common.version});
        std.process.exit(0);
    }
    if (argv.len == 1 and (eql(argv[0], "--help") or eql(argv[0], "-h"))) {
        ctx.out("{s}", .{usage});
        std.process.exit(0);
    }
    var pos: [7][]const u8 = undefined;
    var npos: usize = 0;
    var engram: ?[]const u8 = null;
    var token_map: ?[]const u8 = null;
    var rdma: ?[]const u8 = null;
    var rdma_kernels: ?[]const u8 = null;
    var pool: ?u64 = null;
    var a = common.Args.init(argv);
    while (a.next()) |tok| {
        if (common.oneOf(tok, &numeric_flags)) {
            const v = a.value() orelse ctx.usageError("error: missing value for '{s}'", .{tok});
            const n = std.fmt.parseInt(u64, v, 10) catch ctx.usageError("error: invalid value '{s}' for '{s}'", .{ v, tok });
            if (eql(tok, "--pool")) pool = n;
            continue;
        }
        if (common.oneOf(tok, &path_flags)) {
            const v = a.value() orelse ctx.usageError("error: missing value for '{s}'", .{tok});
            if (eql(tok, "--engram")) {
                engram = v;
            } else if (eql(tok, "--token-map")) {
                token_map = v;
            } else if (eql(tok, "--rdma")) {
                rdma = v;
            } else {
                rdma_kernels = v;
            }
            continue;
        }
        if (common.isFlag(tok) or npos == pos.len) {
            if (a.inline_value) |iv| ctx.usageError("error: unknown argument '{s}={s}'", .{ tok, iv });
            ctx.usageError("error: unknown argument '{s}'", .{tok});
        }
        pos[npos] = tok;
        npos += 1;
    }
    if (npos < pos.len) ctx.usageError("error: expected 7 arguments, got {d}\n{s}", .{ npos, usage });
    const model = pos[0];
    const cache = pos[1];
    const rank = std.fmt.parseInt(u32, pos[2], 10) catch ctx.usageError("error: G: not a number: '{s}'", .{pos[2]});
    const world = std.fmt.parseInt(u32, pos[3], 10) catch ctx.usageError("error: WORLD: not a number: '{s}'", .{pos[3]});
    const master = pos[4];
    const port = std.fmt.parseInt(u16, pos[5], 10) catch ctx.usageError("error: PORT: not a port: '{s}'", .{pos[5]});
    const kit = pos[6];
    if (world != 2 and world != 4) ctx.refuse("WORLD must be 2 or 4, got {d}", .{world});
    if (rank == 0) ctx.refuse("rank 0 is the head (tensorfold-native); tf-dsv41-lanes runs ranks 1..{d}", .{world - 1});
    if (rank >= world) ctx.refuse("rank {d} is not in a world of {d}", .{ rank, world });

    common.requireModel(ctx, model);
    common.requireDir(ctx, "KIT", kit);
    common.requireFile(ctx, "KIT", common.pathJoin(ctx, kit, "MANIFEST"));
    const cache_file = common.checkRankCache(ctx, cache, rank, world);
    if (token_map) |tm| common.requireFile(ctx, "--token-map", tm);
    if (rdma_kernels) |rk| common.requireFile(ctx, "--rdma-kernels", rk);
    if (engram) |eg| common.requireDir(ctx, "--engram", eg);

    ctx.log("rank {d} of {d} dialing {s}:{d} (rank cache {s}, pool {d}, rdma {s})", .{
        rank, world, master, port, cache_file, pool orelse 0, rdma orelse "-",
    });
    _ = rendezvous.follow(ctx, .tensorfold_native, master, port, rank, world, .{});
    std.process.exit(1); // not reached: without a timeout follow() does not return
}
