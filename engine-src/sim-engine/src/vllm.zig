//! vllm: the vLLM lanes (vllm-native, vllm-mia-tp2), every node.
//!
//!   vllm serve MODEL --served-model-name N [--host H] [--port P] --tensor-parallel-size T
//!       --nnodes K --node-rank R --master-addr A --master-port MP [--max-model-len L]
//!       [--gpu-memory-utilization F] [--block-size B] [--quantization Q] [--headless]
//!       and the boot-10 launcher's: [--pipeline-parallel-size N] [--max-num-seqs N]
//!       [--max-num-batched-tokens N] [--mm-processor-cache-gb N] [--engram-config J]
//!       [--default-chat-template-kwargs J] [--speculative-config J] [--limit-mm-per-prompt J]
//!       [--compilation-config J] (J: a JSON object, taken as text) [--distributed-executor-backend B]
//!       [--tool-call-parser P] [--reasoning-parser P] [--tokenizer-mode M] [--enable-auto-tool-choice]
//!       [--enforce-eager]
//!
//! Node rank 0 (without --headless) listens on MP (all addresses) for the other nodes and serves the
//! API on host:port, /health ok once K-1 headless nodes have joined. A --headless node dials A:MP
//! every second until the head answers, joins and holds the connection; it opens no port.
//! Simulator rules (not taken from vLLM): node rank 0 may not be --headless, a node rank >= 1 must be,
//! and T must be a multiple of K.
const std = @import("std");
const common = @import("common.zig");
const rendezvous = @import("rendezvous.zig");
const api = @import("api.zig");

const Ctx = common.Ctx;
const eql = common.eql;

pub const usage = "usage: vllm serve MODEL [--served-model-name NAME] [--host HOST] [--port PORT] " ++
    "[--tensor-parallel-size T] [--nnodes K] [--node-rank R] [--master-addr A] [--master-port P] " ++
    "[--max-model-len L] [--gpu-memory-utilization F] [--block-size B] [--quantization Q] [--headless] " ++
    "[--pipeline-parallel-size N] [--max-num-seqs N] [--max-num-batched-tokens N] [--mm-processor-cache-gb N] " ++
    "[--engram-config J] [--default-chat-template-kwargs J] [--speculative-config J] [--limit-mm-per-prompt J] " ++
    "[--compilation-config J] [--distributed-executor-backend B] [--tool-call-parser P] [--reasoning-parser P] " ++
    "[--tokenizer-mode M] [--enable-auto-tool-choice] [--enforce-eager]";

const value_flags = [_][]const u8{
    "--served-model-name", "--host",         "--port",        "--tensor-parallel-size", "--nnodes",
    "--node-rank",         "--master-addr",  "--master-port", "--max-model-len",        "--gpu-memory-utilization",
    "--block-size",        "--quantization",
};
const int_flags = [_][]const u8{
    "--pipeline-parallel-size", "--max-num-seqs", "--max-num-batched-tokens", "--mm-processor-cache-gb",
};
const json_flags = [_][]const u8{
    "--engram-config", "--default-chat-template-kwargs", "--speculative-config", "--limit-mm-per-prompt",
    "--compilation-config",
};
const text_flags = [_][]const u8{
    "--distributed-executor-backend", "--tool-call-parser", "--reasoning-parser", "--tokenizer-mode",
};
const bool_flags = [_][]const u8{ "--enable-auto-tool-choice", "--enforce-eager" };

fn int(ctx: *const Ctx, comptime T: type, flag: []const u8, v: []const u8) T {
    return std.fmt.parseInt(T, v, 10) catch
        ctx.usageError("{s}\nvllm: error: argument {s}: invalid int value: '{s}'", .{ usage, flag, v });
}

pub fn main(ctx: *const Ctx, argv: []const []const u8) noreturn {
    if (argv.len >= 1 and (eql(argv[0], "--version") or eql(argv[0], "-v"))) {
        ctx.out("vllm {s} (simulator)", .{common.version});
        std.process.exit(0);
    }
    if (argv.len == 0 or !eql(argv[0], "serve")) {
        ctx.usageError("{s}\nvllm: error: argument subparser: invalid choice: '{s}' (choose from 'serve')", .{ usage, if (argv.len == 0) "" else argv[0] });
    }
    var model: ?[]const u8 = null;
    var served: ?[]const u8 = null;
    var host: []const u8 = "0.0.0.0";
    var port: u16 = 8000;
    var tp: u32 = 1;
    var nnodes: u32 = 1;
    var node_rank: u32 = 0;
    var master_addr: ?[]const u8 = null;
    var master_port: ?u16 = null;
    var headless = false;
    var unknown: std.ArrayList(u8) = .empty;
    var a = common.Args.init(argv[1..]);
    while (a.next()) |tok| {
        if (eql(tok, "--headless") and a.inline_value == null) {
            headless = true;
            continue;
        }
        if (common.oneOf(tok, &bool_flags) and a.inline_value == null) continue;
        if (common.oneOf(tok, &int_flags) or common.oneOf(tok, &json_flags) or common.oneOf(tok, &text_flags)) {
            const v = a.value() orelse ctx.usageError("{s}\nvllm: error: argument {s}: expected one argument", .{ usage, tok });
            if (common.oneOf(tok, &int_flags)) _ = int(ctx, u64, tok, v);
            if (common.oneOf(tok, &json_flags) and (v.len < 2 or v[0] != '{' or v[v.len - 1] != '}'))
                ctx.usageError("{s}\nvllm: error: argument {s}: not a JSON object: '{s}'", .{ usage, tok, v });
            continue;
        }
        if (common.oneOf(tok, &value_flags)) {
            const v = a.value() orelse ctx.usageError("{s}\nvllm: error: argument {s}: expected one argument", .{ usage, tok });
            if (eql(tok, "--served-model-name")) {
                served = v;
            } else if (eql(tok, "--host")) {
                host = v;
            } else if (eql(tok, "--port")) {
                port = int(ctx, u16, tok, v);
            } else if (eql(tok, "--tensor-parallel-size")) {
                tp = int(ctx, u32, tok, v);
            } else if (eql(tok, "--nnodes")) {
                nnodes = int(ctx, u32, tok, v);
            } else if (eql(tok, "--node-rank")) {
                node_rank = int(ctx, u32, tok, v);
            } else if (eql(tok, "--master-addr")) {
                master_addr = v;
            } else if (eql(tok, "--master-port")) {
                master_port = int(ctx, u16, tok, v);
            } else if (eql(tok, "--max-model-len") or eql(tok, "--block-size")) {
                _ = int(ctx, u64, tok, v);
            } else if (eql(tok, "--gpu-memory-utilization")) {
                const f = std.fmt.parseFloat(f64, v) catch
                    ctx.usageError("{s}\nvllm: error: argument {s}: invalid float value: '{s}'", .{ usage, tok, v });
                if (!(f > 0 and f <= 1)) ctx.refuse("--gpu-memory-utilization {s}: must be in (0, 1]", .{v});
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
    if (unknown.items.len > 0) ctx.usageError("{s}\nvllm: error: unrecognized arguments: {s}", .{ usage, unknown.items });
    const model_dir = model orelse ctx.usageError("{s}\nvllm: error: the following arguments are required: model_tag", .{usage});
    if (nnodes == 0 or nnodes > rendezvous.max_world) ctx.refuse("--nnodes {d}: the simulator takes 1 to {d}", .{ nnodes, rendezvous.max_world });
    if (node_rank >= nnodes) ctx.refuse("--node-rank {d} is not in --nnodes {d}", .{ node_rank, nnodes });
    if (tp == 0 or tp % nnodes != 0) ctx.refuse("--tensor-parallel-size {d} is not a multiple of --nnodes {d}", .{ tp, nnodes });
    if (node_rank == 0 and headless) ctx.refuse("node rank 0 serves the API: --headless is for node ranks >= 1", .{});
    if (node_rank > 0 and !headless) ctx.refuse("node rank {d} runs --headless (only node rank 0 serves the API)", .{node_rank});
    if (nnodes > 1 and master_addr == null) ctx.refuse("--nnodes {d} needs --master-addr", .{nnodes});
    if (nnodes > 1 and master_port == null) ctx.refuse("--nnodes {d} needs --master-port", .{nnodes});
    common.requireModel(ctx, model_dir);
    const name = served orelse model_dir;

    if (headless) {
        ctx.log("node rank {d} of {d} (headless, tensor parallel {d}) dialing {s}:{d}", .{ node_rank, nnodes, tp, master_addr.?, master_port.? });
        _ = rendezvous.follow(ctx, .vllm, master_addr.?, master_port.?, node_rank, nnodes, .{});
        std.process.exit(1); // not reached: without a timeout follow() does not return
    }
    var reg: ?*rendezvous.Registry = null;
    if (nnodes > 1) {
        ctx.log("node rank 0 of {d} (tensor parallel {d}): serving '{s}' from {s} on {s}:{d}, waiting for {d} headless nodes on 0.0.0.0:{d}", .{
            nnodes, tp, name, model_dir, host, port, nnodes - 1, master_port.?,
        });
        reg = rendezvous.startHead(ctx, .vllm, nnodes, master_port.?);
    } else {
        ctx.log("single node (tensor parallel {d}): serving '{s}' from {s} on {s}:{d}", .{ tp, name, model_dir, host, port });
    }
    const the_api = ctx.arena.create(api.Api) catch common.oom(ctx);
    the_api.* = .{ .served_name = name, .owned_by = "vllm (simulator)", .registry = reg };
    api.serve(ctx, host, port, the_api);
}
