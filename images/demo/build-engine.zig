//! images/demo/build-engine.zig: compile the demo engine with one `zig build-exe`.
//!
//! `zig build` would first compile Zig's build runner (minutes on a small machine) to then run
//! one compile step; this program does that step directly and is itself compiled in a second or
//! two. It reads the build arguments from its environment (RUN in exec form does not expand
//! ${...}), writes the `build_options` module the engine imports (what the engine's build.zig
//! generates with addOptions), and replaces itself with the compiler:
//!
//!   zig build-exe -O<ZIG_OPTIMIZE> -target <ZIG_TARGET> -fstrip -fsingle-threaded -static
//!       --dep build_options -Mroot=src/main.zig -Mbuild_options=<generated>
//!
//! These are the flags build.zig uses (strip unless Debug, single-threaded, static). Environment: ENGINE_COMMIT (40 hex, required), ENGINE_VERSION (default 0.1.0),
//! ZIG_TARGET (default x86_64-linux-musl), ZIG_OPTIMIZE (default ReleaseSmall).
//! usage (in the recipe's build stage, cwd = the engine source):
//!   zig run build-engine.zig -- ZIG OUT_BIN CACHE_DIR
const std = @import("std");

fn fail(comptime fmt: []const u8, args: anytype) noreturn {
    std.debug.print("build-engine: " ++ fmt ++ "\n", args);
    std.process.exit(2);
}

fn plain(value: []const u8, what: []const u8) []const u8 {
    for (value) |c| {
        const ok = std.ascii.isAlphanumeric(c) or c == '.' or c == '-' or c == '_' or c == '+';
        if (!ok) fail("{s}: unexpected character in '{s}'", .{ what, value });
    }
    if (value.len == 0) fail("{s}: empty", .{what});
    return value;
}

pub fn main(init: std.process.Init) !u8 {
    const io = init.io;
    const arena = init.arena.allocator();
    const args = try init.minimal.args.toSlice(arena);
    if (args.len != 4) fail("usage: build-engine ZIG OUT_BIN CACHE_DIR", .{});
    const env = init.environ_map;

    const commit = env.get("ENGINE_COMMIT") orelse fail("ENGINE_COMMIT is not set", .{});
    if (commit.len != 40) fail("ENGINE_COMMIT must be 40 hex digits, got '{s}'", .{commit});
    for (commit) |c| if (!std.ascii.isHex(c)) fail("ENGINE_COMMIT must be 40 hex digits, got '{s}'", .{commit});
    const version = plain(env.get("ENGINE_VERSION") orelse "0.1.0", "ENGINE_VERSION");
    const target = plain(env.get("ZIG_TARGET") orelse "x86_64-linux-musl", "ZIG_TARGET");
    const optimize = plain(env.get("ZIG_OPTIMIZE") orelse "ReleaseSmall", "ZIG_OPTIMIZE");

    const options = try std.fmt.allocPrint(arena,
        \\pub const commit: []const u8 = "{s}";
        \\pub const version: []const u8 = "{s}";
        \\
    , .{ commit, version });
    try std.Io.Dir.cwd().writeFile(io, .{ .sub_path = "build_options.zig", .data = options });

    const argv = [_][]const u8{
        args[1],
        "build-exe",
        try std.fmt.allocPrint(arena, "-O{s}", .{optimize}),
        "-target",
        target,
        if (std.mem.eql(u8, optimize, "Debug")) "-fno-strip" else "-fstrip",
        "-fsingle-threaded",
        "-static",
        "--cache-dir",
        args[3],
        try std.fmt.allocPrint(arena, "-femit-bin={s}", .{args[2]}),
        "--dep",
        "build_options",
        "-Mroot=src/main.zig",
        "-Mbuild_options=build_options.zig",
    };
    const err = std.process.replace(io, .{ .argv = &argv });
    fail("could not run {s}: {t}", .{ args[1], err });
}
