//! demo-engine: a tiny stand-in for tensorfold-native.
//!
//! It answers the same questions bundles and audits ask of the real engine:
//!   demo-engine --version                 -> "demo-engine <version> (commit <40 hex>)"
//!   demo-engine capabilities --json       -> the flags and environment knobs it accepts
//!   demo-engine serve --port N --served-name NAME [--host ADDR]
//!       GET  /health               -> {"status":"ok","rank":R,"world_size":W,...}
//!       GET  /v1/models            -> OpenAI-style model list with the served name
//!       POST /v1/completions       -> a deterministic one-token completion
//!       POST /v1/chat/completions  -> the same, as a chat message
//! Single-threaded, one connection at a time, no allocation per request beyond a small arena.
const std = @import("std");
const build_options = @import("build_options");

const Io = std.Io;
const Writer = Io.Writer;

pub const name = "demo-engine";
/// Appended to the version; a patch from the pins changes it so an applied patch shows in --version.
pub const version_suffix = "";
/// The one token every completion returns.
pub const completion_token = "ok";

const usage =
    \\usage: demo-engine --version
    \\       demo-engine capabilities --json
    \\       demo-engine serve --port N --served-name NAME [--host ADDR]
    \\
;

pub const ServeConfig = struct {
    host: []const u8 = "0.0.0.0",
    port: u16 = 8080,
    served_name: []const u8 = "demo",
};

pub const Topology = struct {
    rank: u32 = 0,
    world_size: u32 = 1,
    master_addr: ?[]const u8 = null,
    master_port: ?u16 = null,
};

/// What `capabilities --json` prints: the flags and environment variables this build understands.
pub const capabilities = .{
    .name = name,
    .version = build_options.version ++ version_suffix,
    .commit = build_options.commit,
    .commands = .{ "serve", "capabilities", "--version" },
    .serve_flags = .{ "--host", "--port", "--served-name" },
    .env = .{ "TF_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT" },
    .endpoints = .{ "/health", "/v1/models", "/v1/completions", "/v1/chat/completions" },
};

pub fn versionLine(w: *Writer) Writer.Error!void {
    try w.print("{s} {s}{s} (commit {s})\n", .{ name, build_options.version, version_suffix, build_options.commit });
}

pub const ArgError = error{ MissingValue, BadPort, UnknownFlag };

pub fn parseServe(args: []const []const u8) ArgError!ServeConfig {
    var cfg: ServeConfig = .{};
    var i: usize = 0;
    while (i < args.len) : (i += 1) {
        const a = args[i];
        if (std.mem.eql(u8, a, "--port") or std.mem.eql(u8, a, "--host") or std.mem.eql(u8, a, "--served-name")) {
            if (i + 1 >= args.len) return error.MissingValue;
            i += 1;
            const v = args[i];
            if (std.mem.eql(u8, a, "--port")) {
                cfg.port = std.fmt.parseInt(u16, v, 10) catch return error.BadPort;
            } else if (std.mem.eql(u8, a, "--host")) {
                cfg.host = v;
            } else {
                cfg.served_name = v;
            }
        } else return error.UnknownFlag;
    }
    return cfg;
}

fn envInt(env: *const std.process.Environ.Map, key: []const u8) ?u32 {
    const v = env.get(key) orelse return null;
    return std.fmt.parseInt(u32, v, 10) catch null;
}

pub fn topologyFromEnv(env: *const std.process.Environ.Map) Topology {
    var t: Topology = .{};
    t.rank = envInt(env, "TF_RANK") orelse envInt(env, "RANK") orelse 0;
    t.world_size = envInt(env, "WORLD_SIZE") orelse 1;
    t.master_addr = env.get("MASTER_ADDR");
    if (env.get("MASTER_PORT")) |p| t.master_port = std.fmt.parseInt(u16, p, 10) catch null;
    return t;
}

pub const Response = struct {
    status: std.http.Status,
    body: []const u8,
};

/// Route one request. `body` is the request body (empty for GET). Pure: the same request gives the same bytes.
pub fn route(
    arena: std.mem.Allocator,
    method: std.http.Method,
    target: []const u8,
    body: []const u8,
    cfg: ServeConfig,
    topo: Topology,
) !Response {
    const path = if (std.mem.indexOfScalar(u8, target, '?')) |q| target[0..q] else target;
    const opts: std.json.Stringify.Options = .{ .emit_null_optional_fields = false };
    if (std.mem.eql(u8, path, "/health")) {
        if (method != .GET and method != .HEAD) return errorResponse(arena, .method_not_allowed, "use GET");
        return .{ .status = .ok, .body = try std.json.Stringify.valueAlloc(arena, .{
            .status = "ok",
            .rank = topo.rank,
            .world_size = topo.world_size,
            .master_addr = topo.master_addr,
            .master_port = topo.master_port,
            .served_name = cfg.served_name,
        }, opts) };
    }
    if (std.mem.eql(u8, path, "/v1/models")) {
        if (method != .GET and method != .HEAD) return errorResponse(arena, .method_not_allowed, "use GET");
        const Model = struct { id: []const u8, object: []const u8, created: u32, owned_by: []const u8 };
        return .{ .status = .ok, .body = try std.json.Stringify.valueAlloc(arena, .{
            .object = "list",
            .data = [_]Model{.{ .id = cfg.served_name, .object = "model", .created = 0, .owned_by = name }},
        }, opts) };
    }
    const chat = std.mem.eql(u8, path, "/v1/chat/completions");
    if (chat or std.mem.eql(u8, path, "/v1/completions")) {
        if (method != .POST) return errorResponse(arena, .method_not_allowed, "use POST");
        const parsed = std.json.parseFromSliceLeaky(std.json.Value, arena, body, .{}) catch
            return errorResponse(arena, .bad_request, "body is not JSON");
        if (parsed != .object) return errorResponse(arena, .bad_request, "body is not a JSON object");
        const Usage = struct { prompt_tokens: u32 = 1, completion_tokens: u32 = 1, total_tokens: u32 = 2 };
        if (chat) {
            const Msg = struct { role: []const u8 = "assistant", content: []const u8 = completion_token };
            const Choice = struct { index: u32 = 0, message: Msg = .{}, finish_reason: []const u8 = "length" };
            return .{ .status = .ok, .body = try std.json.Stringify.valueAlloc(arena, .{
                .id = "cmpl-demo-0",
                .object = "chat.completion",
                .created = 0,
                .model = cfg.served_name,
                .choices = [_]Choice{.{}},
                .usage = Usage{},
            }, opts) };
        }
        const Choice = struct { index: u32 = 0, text: []const u8 = completion_token, finish_reason: []const u8 = "length" };
        return .{ .status = .ok, .body = try std.json.Stringify.valueAlloc(arena, .{
            .id = "cmpl-demo-0",
            .object = "text_completion",
            .created = 0,
            .model = cfg.served_name,
            .choices = [_]Choice{.{}},
            .usage = Usage{},
        }, opts) };
    }
    return errorResponse(arena, .not_found, "no such endpoint");
}

fn errorResponse(arena: std.mem.Allocator, status: std.http.Status, message: []const u8) !Response {
    return .{ .status = status, .body = try std.json.Stringify.valueAlloc(arena, .{
        .@"error" = .{ .message = message, .code = @intFromEnum(status) },
    }, .{}) };
}

fn serve(io: Io, gpa: std.mem.Allocator, cfg: ServeConfig, topo: Topology, log: *Writer) !void {
    const addr = try Io.net.IpAddress.parse(cfg.host, cfg.port);
    var server = try addr.listen(io, .{ .reuse_address = true });
    defer server.deinit(io);
    try log.print("{s}: serving {s} on {s}:{d} (rank {d} of {d})\n", .{ name, cfg.served_name, cfg.host, cfg.port, topo.rank, topo.world_size });
    try log.flush();
    while (true) {
        const stream = server.accept(io) catch |err| {
            try log.print("{s}: accept: {t}\n", .{ name, err });
            try log.flush();
            continue;
        };
        defer stream.close(io);
        handleConnection(io, gpa, stream, cfg, topo) catch {};
    }
}

fn handleConnection(io: Io, gpa: std.mem.Allocator, stream: Io.net.Stream, cfg: ServeConfig, topo: Topology) !void {
    var recv_buf: [8192]u8 = undefined;
    var send_buf: [8192]u8 = undefined;
    var conn_reader = stream.reader(io, &recv_buf);
    var conn_writer = stream.writer(io, &send_buf);
    var http: std.http.Server = .init(&conn_reader.interface, &conn_writer.interface);
    while (true) {
        var request = http.receiveHead() catch return;
        var arena_state: std.heap.ArenaAllocator = .init(gpa);
        defer arena_state.deinit();
        const arena = arena_state.allocator();
        const method = request.head.method;
        const target = try arena.dupe(u8, request.head.target);
        const keep_alive = request.head.keep_alive;
        var body: []const u8 = "";
        if (method.requestHasBody()) {
            var body_buf: [4096]u8 = undefined;
            const r = try request.readerExpectContinue(&body_buf);
            body = r.allocRemaining(arena, .limited(1 << 20)) catch return;
        }
        const resp = try route(arena, method, target, body, cfg, topo);
        try request.respond(resp.body, .{
            .status = resp.status,
            .keep_alive = keep_alive,
            .extra_headers = &.{.{ .name = "content-type", .value = "application/json" }},
        });
        if (!keep_alive) return;
    }
}

pub fn main(init: std.process.Init) !u8 {
    const io = init.io;
    const arena = init.arena.allocator();
    const args = try init.minimal.args.toSlice(arena);

    var out_buf: [4096]u8 = undefined;
    var out_file = Io.File.Writer.initStreaming(.stdout(), io, &out_buf);
    const out = &out_file.interface;
    var err_buf: [1024]u8 = undefined;
    var err_file = Io.File.Writer.initStreaming(.stderr(), io, &err_buf);
    const err = &err_file.interface;

    const rest: []const []const u8 = if (args.len > 1) args[1..] else &.{};
    if (rest.len == 0) {
        try err.writeAll(usage);
        try err.flush();
        return 2;
    }
    const cmd = rest[0];
    if (std.mem.eql(u8, cmd, "--version") or std.mem.eql(u8, cmd, "version")) {
        try versionLine(out);
        try out.flush();
        return 0;
    }
    if (std.mem.eql(u8, cmd, "capabilities")) {
        try std.json.Stringify.value(capabilities, .{}, out);
        try out.writeByte('\n');
        try out.flush();
        return 0;
    }
    if (std.mem.eql(u8, cmd, "serve")) {
        const cfg = parseServe(rest[1..]) catch |e| {
            try err.print("{s}: serve: {t}\n{s}", .{ name, e, usage });
            try err.flush();
            return 2;
        };
        const topo = topologyFromEnv(init.environ_map);
        serve(io, init.gpa, cfg, topo, err) catch |e| {
            try err.print("{s}: serve: {t}\n", .{ name, e });
            try err.flush();
            return 1;
        };
        return 0;
    }
    try err.print("{s}: unknown command '{s}'\n{s}", .{ name, cmd, usage });
    try err.flush();
    return 2;
}

test "serve flags" {
    const cfg = try parseServe(&.{ "--port", "9000", "--served-name", "m", "--host", "127.0.0.1" });
    try std.testing.expectEqual(@as(u16, 9000), cfg.port);
    try std.testing.expectEqualStrings("m", cfg.served_name);
    try std.testing.expectError(error.BadPort, parseServe(&.{ "--port", "x" }));
    try std.testing.expectError(error.MissingValue, parseServe(&.{"--port"}));
}

test "routes are deterministic" {
    var arena_state: std.heap.ArenaAllocator = .init(std.testing.allocator);
    defer arena_state.deinit();
    const a = arena_state.allocator();
    const cfg: ServeConfig = .{ .served_name = "demo" };
    const h = try route(a, .GET, "/health", "", cfg, .{ .rank = 1, .world_size = 2 });
    try std.testing.expectEqualStrings("{\"status\":\"ok\",\"rank\":1,\"world_size\":2,\"served_name\":\"demo\"}", h.body);
    const m = try route(a, .GET, "/v1/models", "", cfg, .{});
    try std.testing.expect(std.mem.indexOf(u8, m.body, "\"id\":\"demo\"") != null);
    const c1 = try route(a, .POST, "/v1/completions", "{\"prompt\":\"hi\"}", cfg, .{});
    const c2 = try route(a, .POST, "/v1/completions", "{\"prompt\":\"hi\"}", cfg, .{});
    try std.testing.expectEqualStrings(c1.body, c2.body);
    const bad = try route(a, .POST, "/v1/completions", "nope", cfg, .{});
    try std.testing.expectEqual(std.http.Status.bad_request, bad.status);
}
