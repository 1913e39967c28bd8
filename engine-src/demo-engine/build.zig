//! demo-engine build: `zig build -Doptimize=ReleaseSmall -Dtarget=x86_64-linux-musl -Dcommit=<40 hex>`
const std = @import("std");

/// The release this tree is; `-Dversion=` overrides it (the builder passes the locked tag).
const default_version = "0.1.0";

pub fn build(b: *std.Build) void {
    const target = b.standardTargetOptions(.{});
    const optimize = b.standardOptimizeOption(.{});
    const commit = b.option([]const u8, "commit", "full git commit of this source (40 hex)") orelse
        "0000000000000000000000000000000000000000";
    const version = b.option([]const u8, "version", "release version") orelse default_version;

    const options = b.addOptions();
    options.addOption([]const u8, "commit", commit);
    options.addOption([]const u8, "version", version);

    const root = b.createModule(.{
        .root_source_file = b.path("src/main.zig"),
        .target = target,
        .optimize = optimize,
        .strip = optimize != .debug,
        .single_threaded = true,
    });
    root.addOptions("build_options", options);

    const exe = b.addExecutable(.{ .name = "demo-engine", .root_module = root });
    exe.linkage = .static;
    b.installArtifact(exe);

    const tests = b.addTest(.{ .root_module = root });
    const run_tests = b.addRunArtifact(tests);
    b.step("test", "Run unit tests").dependOn(&run_tests.step);
}
