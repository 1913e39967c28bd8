//! sim-engine build.
//!
//!   zig build -Doptimize=ReleaseSmall -Dtarget=x86_64-linux-musl -Dcommit=<40 hex> [-Dversion=X.Y.Z]
//!
//! One static binary, zig-out/bin/sim-engine, plus a copy per personality in zig-out/bin
//! (tensorfold-native, tf-dsv41-lanes, tf-dsv41-rank-cache, tensorfold, vllm, python3) so each runs
//! as its name. Inside a Dockerfile, RUN in exec form does not expand build arguments, but it does
//! see them in its environment: ENGINE_COMMIT, ENGINE_VERSION and ZIG_TARGET stand in for -Dcommit,
//! -Dversion and -Dtarget when those flags are not given. Unlike the demo engine it is not
//! single-threaded: a head accepts followers and serves its API at the same time.
const std = @import("std");

/// The release this tree is; `-Dversion=` or ENGINE_VERSION overrides it.
const default_version = "0.1.0";
const unknown_commit = "0000000000000000000000000000000000000000";

const personalities = [_][]const u8{ "tensorfold-native", "tf-dsv41-lanes", "tf-dsv41-rank-cache", "tensorfold", "vllm", "python3" };

fn fromEnv(b: *std.Build, key: []const u8) ?[]const u8 {
    const v = b.graph.environ_map.get(key) orelse return null;
    // What build.zig reads from the environment is invisible to the configure cache.
    b.graph.poisonCache();
    return if (v.len == 0) null else v;
}

pub fn build(b: *std.Build) void {
    var target = b.standardTargetOptions(.{});
    if (target.query.isNative()) {
        if (fromEnv(b, "ZIG_TARGET")) |triple| {
            const query = std.Target.Query.parse(.{ .arch_os_abi = triple }) catch
                std.debug.panic("ZIG_TARGET: not a target triple: {s}", .{triple});
            target = b.resolveTargetQuery(query);
        }
    }
    const optimize = b.standardOptimizeOption(.{});
    const commit = b.option([]const u8, "commit", "full git commit of this source (40 hex)") orelse
        fromEnv(b, "ENGINE_COMMIT") orelse unknown_commit;
    const version = b.option([]const u8, "version", "release version") orelse
        fromEnv(b, "ENGINE_VERSION") orelse default_version;
    if (commit.len != 40) std.debug.panic("commit must be 40 hex digits, got '{s}'", .{commit});

    const options = b.addOptions();
    options.addOption([]const u8, "commit", commit);
    options.addOption([]const u8, "version", version);

    const root = b.createModule(.{
        .root_source_file = b.path("src/main.zig"),
        .target = target,
        .optimize = optimize,
        .strip = optimize != .debug,
    });
    root.addOptions("build_options", options);

    const exe = b.addExecutable(.{ .name = "sim-engine", .root_module = root });
    exe.linkage = .static;
    b.installArtifact(exe);
    for (personalities) |p| {
        const link = b.addInstallFile(exe.getEmittedBin(), b.fmt("bin/{s}", .{p}));
        b.getInstallStep().dependOn(&link.step);
    }

    const tests = b.addTest(.{ .root_module = root });
    const run_tests = b.addRunArtifact(tests);
    b.step("test", "Run unit tests").dependOn(&run_tests.step);
}
