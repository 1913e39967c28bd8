//! tensorfold-native: rank 0 of the Zig TensorFold lanes (tensorfold-tp4, tensorfold-tp2).
//!
//!   tensorfold-native serve MODEL --host H --port P --name N --context C --parallel K
//!       [--backend cuda] [--no-thinking|--thinking] [--max-tokens M] [--temperature X]
//!       [--top-p X] [--top-k N]
//!   env: TF_DS_KIT TF_DS_RANK_CACHE TF_TP_WORLD (2 or 4) TF_TP_MASTER TF_TP_PORT;
//!        TF_DS_TOKEN_MAP, TF_DS_ENGRAM, TF_DS_RDMA_KERNELS checked when set.
//!
//! Listens for the followers (tf-dsv41-lanes) on TF_TP_PORT, all addresses, and serves the API on
//! host:port; /health is 503 until all TF_TP_WORLD-1 followers have joined.
const std = @import("std");
const common = @import("common.zig");
const rendezvous = @import("rendezvous.zig");
const api = @import("api.zig");

const Ctx = common.Ctx;
const eql = common.eql;

pub const usage =
    \\usage: tensorfold-native serve MODEL --host H --port P --name N --context C --parallel K
    \\         [--backend cuda] [--no-thinking|--thinking] [--max-tokens M] [--temperature X]
    \\         [--top-p X] [--top-k N]
    \\       tensorfold-native --version
;

const Serve = struct {
    model: ?[]const u8 = null,
    host: []const u8 = "0.0.0.0",
    port: u16 = 8080,
    name: ?[]const u8 = null,
    context: u64 = 4096,
    parallel: u32 = 1,
    backend: []const u8 = "cuda",
    thinking: bool = true,
};

fn parseNum(ctx: *const Ctx, comptime T: type, flag: []const u8, v: []const u8) T {
    if (@typeInfo(T) == .float) return std.fmt.parseFloat(T, v) catch
        ctx.usageError("error: invalid value '{s}' for '{s}'", .{ v, flag });
    return std.fmt.parseInt(T, v, 10) catch ctx.usageError("error: invalid value '{s}' for '{s}'", .{ v, flag });
}

pub fn main(ctx: *const Ctx, argv: []const []const u8) noreturn {
    if (argv.len == 0) ctx.usageError("{s}", .{usage});
    if (eql(argv[0], "--version")) {
        ctx.out("tensorfold-native {s} (simulator)", .{common.version});
        std.process.exit(0);
    }
    if (eql(argv[0], "--help") or eql(argv[0], "-h")) {
        ctx.out("{s}", .{usage});
        std.process.exit(0);
    }
    if (!eql(argv[0], "serve")) ctx.usageError("error: unknown command '{s}'\n{s}", .{ argv[0], usage });

    var cfg: Serve = .{};
    var a = common.Args.init(argv[1..]);
    while (a.next()) |tok| {
        if (eql(tok, "--no-thinking") or eql(tok, "--thinking")) {
            if (a.inline_value != null) ctx.usageError("error: unknown argument '{s}={s}'", .{ tok, a.inline_value.? });
            cfg.thinking = eql(tok, "--thinking");
            continue;
        }
        if (common.oneOf(tok, &.{ "--host", "--port", "--name", "--context", "--parallel", "--backend", "--max-tokens", "--temperature", "--top-p", "--top-k" })) {
            const v = a.value() orelse ctx.usageError("error: missing value for '{s}'", .{tok});
            if (eql(tok, "--host")) {
                cfg.host = v;
            } else if (eql(tok, "--port")) {
                cfg.port = parseNum(ctx, u16, tok, v);
            } else if (eql(tok, "--name")) {
                cfg.name = v;
            } else if (eql(tok, "--context")) {
                cfg.context = parseNum(ctx, u64, tok, v);
            } else if (eql(tok, "--parallel")) {
                cfg.parallel = parseNum(ctx, u32, tok, v);
            } else if (eql(tok, "--max-tokens")) {
                _ = parseNum(ctx, u64, tok, v);
            } else if (eql(tok, "--temperature") or eql(tok, "--top-p")) {
                _ = parseNum(ctx, f64, tok, v);
            } else if (eql(tok, "--top-k")) {
                _ = parseNum(ctx, u32, tok, v);
            } else { // --backend
                if (!eql(v, "cuda")) ctx.usageError("error: invalid value '{s}' for '--backend' (this build has: cuda)", .{v});
                cfg.backend = v;
            }
            continue;
        }
        if (common.isFlag(tok) or cfg.model != null) {
            if (a.inline_value) |iv| ctx.usageError("error: unknown argument '{s}={s}'", .{ tok, iv });
            ctx.usageError("error: unknown argument '{s}'", .{tok});
        }
        cfg.model = tok;
    }
    const model = cfg.model orelse ctx.usageError("error: missing MODEL\n{s}", .{usage});
    if (cfg.parallel == 0) ctx.usageError("error: invalid value '0' for '--parallel'", .{});

    // The environment, in the order the real engine reads it.
    const kit = ctx.requireEnv("TF_DS_KIT");
    const cache = ctx.requireEnv("TF_DS_RANK_CACHE");
    const world_s = ctx.requireEnv("TF_TP_WORLD");
    const master = ctx.requireEnv("TF_TP_MASTER");
    const port_s = ctx.requireEnv("TF_TP_PORT");
    const world = ctx.envInt(u32, "TF_TP_WORLD", world_s);
    if (world != 2 and world != 4) ctx.refuse("TF_TP_WORLD must be 2 or 4, got {d}", .{world});
    const tp_port = ctx.envInt(u16, "TF_TP_PORT", port_s);

    // The inputs, checked before anything is loaded.
    common.requireModel(ctx, model);
    common.requireDir(ctx, "TF_DS_KIT", kit);
    common.requireFile(ctx, "TF_DS_KIT", common.pathJoin(ctx, kit, "MANIFEST"));
    const cache_file = common.checkRankCache(ctx, cache, 0, world);
    if (ctx.env.get("TF_DS_TOKEN_MAP")) |tm| common.requireFile(ctx, "TF_DS_TOKEN_MAP", tm);
    if (ctx.env.get("TF_DS_ENGRAM")) |eg| common.requireDir(ctx, "TF_DS_ENGRAM", eg);
    if (ctx.env.get("TF_DS_RDMA_KERNELS")) |rk| common.requireFile(ctx, "TF_DS_RDMA_KERNELS", rk);

    const served = cfg.name orelse std.fs.path.basename(model);
    ctx.log("rank 0 of {d} (head, master {s}): model {s}, rank cache {s}, serving '{s}' on {s}:{d} (context {d}, parallel {d}, backend {s}); waiting for {d} followers on 0.0.0.0:{d}", .{
        world, master, model, cache_file, served, cfg.host, cfg.port, cfg.context, cfg.parallel, cfg.backend, world - 1, tp_port,
    });
    const reg = rendezvous.startHead(ctx, .tensorfold_native, world, tp_port);
    const the_api = ctx.arena.create(api.Api) catch common.oom(ctx);
    the_api.* = .{ .served_name = served, .owned_by = "tensorfold-native (simulator)", .registry = reg };
    api.serve(ctx, cfg.host, cfg.port, the_api);
}
