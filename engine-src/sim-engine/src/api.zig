//! The OpenAI-style API a head serves: /health, /v1/models, /v1/completions, /v1/chat/completions.
//! /health answers 503 {"status":"loading","joined":J,"world":W} until every rank has joined
//! (J counts the ranks up, the head included), then 200 {"status":"ok"}. Completions answer one
//! deterministic token ("ok"), the shape checks/test_serving.py and the demo engine use.
const std = @import("std");
const common = @import("common.zig");
const rendezvous = @import("rendezvous.zig");

const Io = std.Io;
const Ctx = common.Ctx;

/// The one token every completion returns.
pub const completion_token = "ok";

pub const Api = struct {
    /// The name completions answer as (and the first model /v1/models lists).
    served_name: []const u8,
    /// More ids /v1/models lists after it (the Python engine's, see tensorfold_py.zig).
    also_listed: []const []const u8 = &.{},
    owned_by: []const u8,
    registry: ?*const rendezvous.Registry,

    fn ready(a: *const Api) bool {
        const r = a.registry orelse return true;
        return r.ready();
    }
};

pub const Response = struct {
    status: std.http.Status,
    body: []const u8,
};

/// Route one request. Pure apart from the registry's join count.
pub fn route(arena: std.mem.Allocator, method: std.http.Method, target: []const u8, body: []const u8, api: *const Api) !Response {
    const path = if (std.mem.indexOfScalar(u8, target, '?')) |q| target[0..q] else target;
    if (std.mem.eql(u8, path, "/health")) {
        if (method != .GET and method != .HEAD) return errorResponse(arena, .method_not_allowed, "use GET");
        if (api.registry) |reg| if (!reg.ready()) {
            return .{ .status = .service_unavailable, .body = try std.json.Stringify.valueAlloc(arena, .{
                .status = "loading",
                .joined = reg.joined(),
                .world = reg.world,
            }, .{}) };
        };
        return .{ .status = .ok, .body = "{\"status\":\"ok\"}" };
    }
    if (std.mem.eql(u8, path, "/v1/models")) {
        if (method != .GET and method != .HEAD) return errorResponse(arena, .method_not_allowed, "use GET");
        const Model = struct { id: []const u8, object: []const u8 = "model", created: u32 = 0, owned_by: []const u8 };
        const models = try arena.alloc(Model, 1 + api.also_listed.len);
        models[0] = .{ .id = api.served_name, .owned_by = api.owned_by };
        for (api.also_listed, models[1..]) |id, *m| m.* = .{ .id = id, .owned_by = api.owned_by };
        return .{ .status = .ok, .body = try std.json.Stringify.valueAlloc(arena, .{
            .object = "list",
            .data = models,
        }, .{}) };
    }
    const chat = std.mem.eql(u8, path, "/v1/chat/completions");
    if (chat or std.mem.eql(u8, path, "/v1/completions")) {
        if (method != .POST) return errorResponse(arena, .method_not_allowed, "use POST");
        if (!api.ready()) return errorResponse(arena, .service_unavailable, "loading: not every rank has joined");
        const parsed = std.json.parseFromSliceLeaky(std.json.Value, arena, body, .{}) catch
            return errorResponse(arena, .bad_request, "body is not JSON");
        if (parsed != .object) return errorResponse(arena, .bad_request, "body is not a JSON object");
        const Usage = struct { prompt_tokens: u32 = 1, completion_tokens: u32 = 1, total_tokens: u32 = 2 };
        if (chat) {
            const Msg = struct { role: []const u8 = "assistant", content: []const u8 = completion_token };
            const Choice = struct { index: u32 = 0, message: Msg = .{}, finish_reason: []const u8 = "length" };
            return .{ .status = .ok, .body = try std.json.Stringify.valueAlloc(arena, .{
                .id = "cmpl-sim-0",
                .object = "chat.completion",
                .created = 0,
                .model = api.served_name,
                .choices = [_]Choice{.{}},
                .usage = Usage{},
            }, .{}) };
        }
        const Choice = struct { index: u32 = 0, text: []const u8 = completion_token, finish_reason: []const u8 = "length" };
        return .{ .status = .ok, .body = try std.json.Stringify.valueAlloc(arena, .{
            .id = "cmpl-sim-0",
            .object = "text_completion",
            .created = 0,
            .model = api.served_name,
            .choices = [_]Choice{.{}},
            .usage = Usage{},
        }, .{}) };
    }
    return errorResponse(arena, .not_found, "no such endpoint");
}

fn errorResponse(arena: std.mem.Allocator, status: std.http.Status, message: []const u8) !Response {
    return .{ .status = status, .body = try std.json.Stringify.valueAlloc(arena, .{
        .@"error" = .{ .message = message, .code = @backingInt(status) },
    }, .{}) };
}

/// Listen on host:port (refusing when it cannot) and serve forever, one task per connection.
pub fn serve(ctx: *const Ctx, host: []const u8, port: u16, api: *const Api) noreturn {
    const io = ctx.io;
    const addr = Io.net.IpAddress.parse(host, port) catch
        ctx.refuse("--host {s}: not an IP address", .{host});
    var server = addr.listen(io, .{ .reuse_address = true }) catch |e|
        ctx.refuse("cannot listen on {s}:{d}: {t}", .{ host, port, e });
    var group: Io.Group = .init;
    while (true) {
        const stream = server.accept(io) catch |e| {
            ctx.log("accept: {t}", .{e});
            io.sleep(.fromMilliseconds(100), .awake) catch {};
            continue;
        };
        group.concurrent(io, connectionTask, .{ ctx, stream, api }) catch {
            connectionTask(ctx, stream, api) catch {};
        };
    }
}

fn connectionTask(ctx: *const Ctx, stream: Io.net.Stream, api: *const Api) Io.Cancelable!void {
    defer stream.close(ctx.io);
    handleConnection(ctx, stream, api) catch {};
}

fn handleConnection(ctx: *const Ctx, stream: Io.net.Stream, api: *const Api) !void {
    const io = ctx.io;
    var recv_buf: [8192]u8 = undefined;
    var send_buf: [8192]u8 = undefined;
    var conn_reader = stream.reader(io, &recv_buf);
    var conn_writer = stream.writer(io, &send_buf);
    var http: std.http.Server = .init(&conn_reader.interface, &conn_writer.interface);
    while (true) {
        var request = http.receiveHead() catch return;
        var arena_state: std.heap.ArenaAllocator = .init(ctx.gpa);
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
        const resp = try route(arena, method, target, body, api);
        try request.respond(resp.body, .{
            .status = resp.status,
            .keep_alive = keep_alive,
            .extra_headers = &.{.{ .name = "content-type", .value = "application/json" }},
        });
        if (!keep_alive) return;
    }
}

test "health follows the registry" {
    var arena_state: std.heap.ArenaAllocator = .init(std.testing.allocator);
    defer arena_state.deinit();
    const a = arena_state.allocator();
    var reg: rendezvous.Registry = .{ .ctx = undefined, .family = .vllm, .world = 2, .port = 1 };
    const api: Api = .{ .served_name = "m", .owned_by = "sim", .registry = &reg };
    const h1 = try route(a, .GET, "/health", "", &api);
    try std.testing.expectEqual(std.http.Status.service_unavailable, h1.status);
    try std.testing.expectEqualStrings("{\"status\":\"loading\",\"joined\":1,\"world\":2}", h1.body);
    const c1 = try route(a, .POST, "/v1/completions", "{}", &api);
    try std.testing.expectEqual(std.http.Status.service_unavailable, c1.status);
    _ = reg.mask.fetchOr(2, .acq_rel);
    const h2 = try route(a, .GET, "/health", "", &api);
    try std.testing.expectEqual(std.http.Status.ok, h2.status);
    try std.testing.expectEqualStrings("{\"status\":\"ok\"}", h2.body);
    const c2 = try route(a, .POST, "/v1/completions", "{\"prompt\":\"hi\"}", &api);
    try std.testing.expect(std.mem.indexOf(u8, c2.body, "\"text\":\"ok\"") != null);
}
