//! sim-engine: a SIMULATOR of the seed lanes' engines, one static multi-call binary.
//!
//! It is chosen by the name it runs as (argv[0]'s basename) or by `sim-engine NAME ARGS...`:
//!   tensorfold-native     rank 0 of the Zig TensorFold lanes          (tensorfold_native.zig)
//!   tf-dsv41-lanes        their followers, ranks >= 1                  (lanes.zig)
//!   tf-dsv41-rank-cache   one rank's weight file                       (rank_cache.zig)
//!   tensorfold            TensorFold's Python engine, every rank       (tensorfold_py.zig)
//!   vllm                  vLLM serve, head and --headless nodes        (vllm.zig)
//!   python3 / python      pack_engram.py only                          (pack_engram.zig)
//! Each takes the real engine's command line and environment, refuses what it refuses, and makes the
//! same rendezvous in the same direction; none runs a model (see README.md).
const std = @import("std");
const common = @import("common.zig");

const tensorfold_native = @import("tensorfold_native.zig");
const lanes = @import("lanes.zig");
const rank_cache = @import("rank_cache.zig");
const tensorfold_py = @import("tensorfold_py.zig");
const vllm = @import("vllm.zig");
const pack_engram = @import("pack_engram.zig");
const api = @import("api.zig");

pub const name = "sim-engine";

const Personality = struct {
    name: []const u8,
    run: *const fn (ctx: *const common.Ctx, argv: []const []const u8) noreturn,
};

pub const personalities = [_]Personality{
    .{ .name = "tensorfold-native", .run = tensorfold_native.main },
    .{ .name = "tf-dsv41-lanes", .run = lanes.main },
    .{ .name = "tf-dsv41-rank-cache", .run = rank_cache.main },
    .{ .name = "tensorfold", .run = tensorfold_py.main },
    .{ .name = "vllm", .run = vllm.main },
    .{ .name = "python3", .run = pack_engram.main },
    .{ .name = "python", .run = pack_engram.main },
};

const usage =
    \\usage: sim-engine NAME [ARGS...]     (or run it as NAME: a link or copy named so)
    \\       sim-engine --version
    \\NAME: tensorfold-native, tf-dsv41-lanes, tf-dsv41-rank-cache, tensorfold, vllm, python3
    \\sim-engine is a SIMULATOR: it checks command lines, inputs and the rendezvous; it runs no model.
;

fn find(n: []const u8) ?Personality {
    for (personalities) |p| if (std.mem.eql(u8, p.name, n)) return p;
    // python3.12 and the like
    if (std.mem.startsWith(u8, n, "python3.")) return personalities[5];
    return null;
}

// ------------------------------------------------------------------------------ signals

var stop_message_buf: [128]u8 = undefined;
var stop_message_len: usize = 0;

fn onStop(_: std.posix.SIG) callconv(.c) void {
    _ = std.os.linux.write(2, &stop_message_buf, stop_message_len);
    std.os.linux.exit_group(0);
}

/// SIGTERM and SIGINT end the process at once (exit 0), even as PID 1 without an init.
fn installStopHandler(who: []const u8) void {
    const msg = std.fmt.bufPrint(&stop_message_buf, "{s} (simulator): stopping on a signal\n", .{who}) catch
        "sim-engine (simulator): stopping on a signal\n";
    stop_message_len = msg.len;
    if (msg.ptr != &stop_message_buf) {
        @memcpy(stop_message_buf[0..msg.len], msg);
    }
    const act: std.posix.Sigaction = .{
        .handler = .{ .handler = onStop },
        .mask = std.posix.sigemptyset(),
        .flags = 0,
    };
    std.posix.sigaction(.TERM, &act, null);
    std.posix.sigaction(.INT, &act, null);
}

// ------------------------------------------------------------------------------ main

pub fn main(init: std.process.Init) !u8 {
    const arena = init.arena.allocator();
    const args = try init.minimal.args.toSlice(arena);
    var ctx: common.Ctx = .{
        .io = init.io,
        .arena = arena,
        .gpa = init.gpa,
        .env = init.environ_map,
        .name = name,
    };
    const argv0 = if (args.len > 0) std.fs.path.basename(args[0]) else name;
    var rest: []const []const u8 = if (args.len > 1) args[1..] else &.{};
    var who = find(argv0);
    if (who == null) {
        // sim-engine itself (or any other name): the personality is the first argument.
        if (rest.len == 0) ctx.usageError("{s}", .{usage});
        if (std.mem.eql(u8, rest[0], "--version")) {
            ctx.out("{s} {s} (simulator, commit {s})", .{ name, common.version, common.commit });
            return 0;
        }
        if (std.mem.eql(u8, rest[0], "--help") or std.mem.eql(u8, rest[0], "-h")) {
            ctx.out("{s}", .{usage});
            return 0;
        }
        who = find(rest[0]) orelse ctx.usageError("sim-engine: unknown personality '{s}'\n{s}", .{ rest[0], usage });
        rest = rest[1..];
    }
    ctx.name = who.?.name;
    installStopHandler(ctx.name);
    // SIM_FAULT (a fault the heads' API shows, see api.zig): an unknown one is refused by every
    // personality, before anything else.
    _ = api.faultFromEnv(&ctx);
    who.?.run(&ctx, rest);
}

test {
    _ = common;
    _ = @import("api.zig");
    _ = @import("model.zig");
    _ = @import("rendezvous.zig");
}
