//! images/sim/build-sim.zig: compile the simulator engine with one `zig build-exe` and lay out the
//! image's whole file tree, so the final stage is one COPY (one layer).
//!
//! Like images/demo/build-engine.zig it skips `zig build` (which first compiles Zig's build runner,
//! minutes on a small machine): it reads the build arguments from its environment (RUN in exec form
//! does not expand ${...}), writes the `build_options` module the engine imports (what the engine's
//! build.zig generates with addOptions), and runs the compiler:
//!
//!   zig build-exe -O<ZIG_OPTIMIZE> -target <ZIG_TARGET> -fstrip -static
//!       --dep build_options -Mroot=src/main.zig -Mbuild_options=<generated>
//!
//! (build.zig's flags: strip unless Debug, static; not single-threaded, since a head accepts its
//! followers while it serves its API). Then it copies the one binary to every path the seed lanes
//! run, and writes the placeholder files:
//!
//!   OUT_TREE/engine/{tensorfold-native,tensorfold,tf-dsv41-lanes,tf-dsv41-rank-cache}
//!   OUT_TREE/usr/local/bin/{tensorfold,vllm,python3}   OUT_TREE/usr/bin/python3
//!   OUT_TREE/engine/rdma_gather.fatbin                  a PLACEHOLDER, not a CUDA fatbin: the
//!                                                       lanes pass its path; the simulator only
//!                                                       checks that it exists
//!   OUT_TREE/opt/tensorfold/scripts/pack_engram.py      a marker: python3 (the simulator) checks
//!                                                       the script exists, then simulates it
//!   OUT_TREE/usr/local/lib/python3.12/dist-packages/vllm/<7 paths>   markers: the vLLM tree's files the
//!                                                       vllm-native lanes mount their patches over
//!
//! Environment: ENGINE_COMMIT (40 hex, required), ENGINE_VERSION (default 0.1.0), ZIG_TARGET
//! (default x86_64-linux-musl), ZIG_OPTIMIZE (default ReleaseSmall).
//! usage (in the recipe's build stage, cwd = the engine source):
//!   zig run build-sim.zig -- ZIG OUT_TREE CACHE_DIR
const std = @import("std");

const Io = std.Io;

fn fail(comptime fmt: []const u8, args: anytype) noreturn {
    std.debug.print("build-sim: " ++ fmt ++ "\n", args);
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

/// Where the binary goes, relative to OUT_TREE; the first is where it is compiled to.
const binary_paths = [_][]const u8{
    "engine/tensorfold-native",
    "engine/tensorfold",
    "engine/tf-dsv41-lanes",
    "engine/tf-dsv41-rank-cache",
    "usr/local/bin/tensorfold",
    "usr/local/bin/vllm",
    "usr/local/bin/python3",
    "usr/bin/python3",
};

/// The vLLM tree's files that the vllm-native lanes bind-mount their boot-10 patches over (recipes.md
/// §2.2): the real image (the e47aa780 tree) has them, so a stand-in image must too, or builder's
/// mount-target check refuses the lanes.
const vllm_tree_marker = "# MARKER: stands in for the vLLM tree's file at this path (the vllm-native lanes mount a patched copy over it).\n";

const placeholders = [_]struct { path: []const u8, data: []const u8 }{
    .{
        .path = "engine/rdma_gather.fatbin",
        .data = "PLACEHOLDER: not a CUDA fatbin. sim-engine simulates the TensorFold lanes and only checks that this file exists.\n",
    },
    .{
        .path = "opt/tensorfold/scripts/pack_engram.py",
        .data = "# MARKER: sim-engine's python3 checks that this script exists, then simulates pack_engram.py itself.\n",
    },
    .{
        .path = "usr/local/lib/python3.12/dist-packages/vllm/models/deepseek_v4_1/common/engram.py",
        .data = vllm_tree_marker,
    },
    .{
        .path = "usr/local/lib/python3.12/dist-packages/vllm/models/deepseek_v4_1/nvidia/model_state.py",
        .data = vllm_tree_marker,
    },
    .{
        .path = "usr/local/lib/python3.12/dist-packages/vllm/model_executor/model_loader/weight_utils.py",
        .data = vllm_tree_marker,
    },
    .{
        .path = "usr/local/lib/python3.12/dist-packages/vllm/models/deepseek_v4_1/attention.py",
        .data = vllm_tree_marker,
    },
    .{
        .path = "usr/local/lib/python3.12/dist-packages/vllm/models/deepseek_v4_1/nvidia/flashinfer_sparse.py",
        .data = vllm_tree_marker,
    },
    .{
        .path = "usr/local/lib/python3.12/dist-packages/vllm/v1/attention/backends/mla/sparse_swa.py",
        .data = vllm_tree_marker,
    },
    .{
        .path = "usr/local/lib/python3.12/dist-packages/vllm/model_executor/layers/sparse_attn_indexer.py",
        .data = vllm_tree_marker,
    },
};

pub fn main(init: std.process.Init) !u8 {
    const io = init.io;
    const arena = init.arena.allocator();
    const args = try init.minimal.args.toSlice(arena);
    if (args.len != 4) fail("usage: build-sim ZIG OUT_TREE CACHE_DIR", .{});
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
    const cwd = Io.Dir.cwd();
    try cwd.writeFile(io, .{ .sub_path = "build_options.zig", .data = options });

    const out_tree = args[2];
    try cwd.createDirPath(io, out_tree);
    var tree = try cwd.openDir(io, out_tree, .{});
    defer tree.close(io);
    try tree.createDirPath(io, "engine");
    const first = try std.fs.path.join(arena, &.{ out_tree, binary_paths[0] });

    const argv = [_][]const u8{
        args[1],
        "build-exe",
        try std.fmt.allocPrint(arena, "-O{s}", .{optimize}),
        "-target",
        target,
        if (std.mem.eql(u8, optimize, "Debug")) "-fno-strip" else "-fstrip",
        "-static",
        "--cache-dir",
        args[3],
        try std.fmt.allocPrint(arena, "-femit-bin={s}", .{first}),
        "--dep",
        "build_options",
        "-Mroot=src/main.zig",
        "-Mbuild_options=build_options.zig",
    };
    var child = std.process.spawn(io, .{ .argv = &argv }) catch |err| fail("could not run {s}: {t}", .{ args[1], err });
    const term = try child.wait(io);
    switch (term) {
        .exited => |code| if (code != 0) fail("zig build-exe exited {d}", .{code}),
        else => fail("zig build-exe ended with {any}", .{term}),
    }

    for (binary_paths[1..]) |rel| {
        try tree.copyFile(binary_paths[0], tree, rel, io, .{ .make_path = true });
    }
    for (placeholders) |p| {
        if (std.fs.path.dirname(p.path)) |d| try tree.createDirPath(io, d);
        try tree.writeFile(io, .{ .sub_path = p.path, .data = p.data });
    }
    std.debug.print("build-sim: sim-engine {s} (commit {s}) for {s} at {d} paths under {s}\n", .{ version, commit, target, binary_paths.len, out_tree });
    return 0;
}
