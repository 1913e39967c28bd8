//! The OpenAI-style API a head serves: /health, /v1/models, /v1/completions, /v1/chat/completions.
//! /health answers 503 {"status":"loading","joined":J,"world":W} until every rank has joined
//! (J counts the ranks up, the head included), then 200 {"status":"ok"}.
//!
//! Completions answer as vLLM's OpenAI server does, deterministically (model.zig says what): the same
//! request gives the same bytes, whatever else runs at the same time. Chat completions take
//! `messages`, `max_tokens` (default 64), `stream`, `stream_options.include_usage`, `tools`,
//! `tool_choice`, `return_token_ids`, `chat_template_kwargs.thinking` and TensorFold's `draft`
//! (accepted; drafts never change an answer); `temperature` and unknown fields are ignored (greedy).
//! A streamed answer is written whole, as server-sent events, one token a chunk.
//!
//! SIM_FAULT=garbage-token (read by `serve`) makes every completion one repeated token.
const std = @import("std");
const common = @import("common.zig");
const rendezvous = @import("rendezvous.zig");
const model = @import("model.zig");

const Io = std.Io;
const Ctx = common.Ctx;
const Value = std.json.Value;
const ObjectMap = std.json.ObjectMap;
const Allocator = std.mem.Allocator;

/// `created` of every response: fixed, so the same request gives the same bytes.
pub const created: u64 = 1738368000;
/// max_tokens when a request gives none.
pub const default_max_tokens: usize = 64;
/// The most tokens the garbage-token fault answers.
pub const garbage_max: usize = 64;

/// A fault the simulator can be asked to show (SIM_FAULT).
pub const Fault = enum {
    none,
    /// "an image built from a force-pushed branch": boots cleanly, answers one token repeated.
    garbage_token,
};
pub const known_faults = "garbage-token";

/// SIM_FAULT's value: unset or empty is no fault.
pub fn parseFault(v: ?[]const u8) error{UnknownFault}!Fault {
    const s = v orelse return .none;
    if (s.len == 0) return .none;
    if (std.mem.eql(u8, s, "garbage-token")) return .garbage_token;
    return error.UnknownFault;
}

/// The fault SIM_FAULT names; refuses to start (exit 1, one line) for an unknown one.
pub fn faultFromEnv(ctx: *const Ctx) Fault {
    const v = ctx.env.get("SIM_FAULT");
    return parseFault(v) catch ctx.refuse("SIM_FAULT: unknown fault '{s}' (known: {s})", .{ v.?, known_faults });
}

pub const Api = struct {
    /// The name completions answer as (and the first model /v1/models lists).
    served_name: []const u8,
    /// More ids /v1/models lists after it (the Python engine's, see tensorfold_py.zig).
    also_listed: []const []const u8 = &.{},
    owned_by: []const u8,
    registry: ?*const rendezvous.Registry,
    /// Set by `serve` from SIM_FAULT.
    fault: Fault = .none,

    fn ready(a: *const Api) bool {
        const r = a.registry orelse return true;
        return r.ready();
    }
};

pub const Response = struct {
    status: std.http.Status,
    body: []const u8,
    content_type: []const u8 = "application/json",
};

/// Route one request. Pure apart from the registry's join count.
pub fn route(arena: Allocator, method: std.http.Method, target: []const u8, body: []const u8, api: *const Api) !Response {
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
        const parsed = std.json.parseFromSliceLeaky(Value, arena, body, .{}) catch
            return errorResponse(arena, .bad_request, "body is not JSON");
        if (parsed != .object) return errorResponse(arena, .bad_request, "body is not a JSON object");
        var bad: ?[]const u8 = null;
        const resp = (if (chat)
            chatCompletion(arena, parsed.object, api, &bad)
        else
            textCompletion(arena, parsed.object, api, &bad)) catch |e| switch (e) {
            error.BadRequest => return errorResponse(arena, .bad_request, bad orelse "bad request"),
            else => |other| return other,
        };
        return resp;
    }
    return errorResponse(arena, .not_found, "no such endpoint");
}

fn errorResponse(arena: Allocator, status: std.http.Status, message: []const u8) !Response {
    return .{ .status = status, .body = try std.json.Stringify.valueAlloc(arena, .{
        .@"error" = .{ .message = message, .code = @backingInt(status) },
    }, .{}) };
}

// ------------------------------------------------------------------------------ request fields

const Bad = error{BadRequest};

fn fail(bad: *?[]const u8, message: []const u8) Bad {
    bad.* = message;
    return error.BadRequest;
}

fn field(obj: ObjectMap, key: []const u8) ?Value {
    const v = obj.get(key) orelse return null;
    return if (v == .null) null else v;
}

fn boolField(obj: ObjectMap, key: []const u8, bad: *?[]const u8, comptime message: []const u8) Bad!?bool {
    const v = field(obj, key) orelse return null;
    if (v != .bool) return fail(bad, message);
    return v.bool;
}

/// What both endpoints take besides the prompt.
const Common = struct {
    max_tokens: usize = default_max_tokens,
    stream: bool = false,
    include_usage: bool = false,
    return_ids: bool = false,
};

fn commonFields(req: ObjectMap, bad: *?[]const u8) Bad!Common {
    var c: Common = .{};
    const mt = field(req, "max_tokens") orelse field(req, "max_completion_tokens");
    if (mt) |v| {
        const n: i64 = switch (v) {
            .integer => |i| i,
            .float => |f| if (f == @trunc(f) and f >= -1e15 and f <= 1e15) @intFromFloat(f) else return fail(bad, "max_tokens: expected an integer"),
            else => return fail(bad, "max_tokens: expected an integer"),
        };
        if (n < 1) return fail(bad, "max_tokens must be at least 1");
        c.max_tokens = @intCast(n);
    }
    c.stream = try boolField(req, "stream", bad, "stream: expected a boolean") orelse false;
    c.return_ids = try boolField(req, "return_token_ids", bad, "return_token_ids: expected a boolean") orelse false;
    if (field(req, "stream_options")) |so| {
        if (so != .object) return fail(bad, "stream_options: expected an object");
        c.include_usage = try boolField(so.object, "include_usage", bad, "stream_options.include_usage: expected a boolean") orelse false;
    }
    // TensorFold's per-request switch for speculative drafts: drafts never change an answer here.
    _ = try boolField(req, "draft", bad, "draft: expected a boolean");
    return c;
}

/// A message's content as text: a string, null (""), or a list of parts whose "text" parts count.
fn contentText(arena: Allocator, v: ?Value, bad: *?[]const u8) ![]const u8 {
    const c = v orelse return "";
    switch (c) {
        .null => return "",
        .string => |s| return s,
        .array => |parts| {
            var out: std.ArrayList(u8) = .empty;
            for (parts.items) |p| {
                if (p != .object) return fail(bad, "messages: a content part must be an object");
                if (field(p.object, "text")) |t| if (t == .string) try out.appendSlice(arena, t.string);
            }
            return out.items;
        },
        else => return fail(bad, "messages: content must be a string, a list of parts or null"),
    }
}

// ------------------------------------------------------------------------------ JSON shapes (vLLM's)

const Usage = struct { prompt_tokens: usize, total_tokens: usize, completion_tokens: usize };
const Function = struct { name: []const u8, arguments: []const u8 };
const ToolCallOut = struct { id: []const u8, type: []const u8 = "function", function: Function };
const ToolCallDelta = struct { index: u32 = 0, id: []const u8, type: []const u8 = "function", function: Function };
const Message = struct {
    role: []const u8 = "assistant",
    content: Value,
    reasoning_content: ?[]const u8 = null,
    tool_calls: ?[]const ToolCallOut = null,
};
const ChatChoice = struct {
    index: u32 = 0,
    message: Message,
    logprobs: Value = .null,
    finish_reason: []const u8,
    stop_reason: Value = .null,
    token_ids: ?[]const u32 = null,
};
const ChatResponse = struct {
    id: []const u8,
    object: []const u8 = "chat.completion",
    created: u64 = created,
    model: []const u8,
    choices: []const ChatChoice,
    usage: Usage,
    prompt_token_ids: ?[]const u32 = null,
};
const Delta = struct {
    role: ?[]const u8 = null,
    content: ?[]const u8 = null,
    reasoning_content: ?[]const u8 = null,
    tool_calls: ?[]const ToolCallDelta = null,
};
const ChunkChoice = struct {
    index: u32 = 0,
    delta: Delta,
    logprobs: Value = .null,
    finish_reason: Value = .null,
    token_ids: ?[]const u32 = null,
};
const ChatChunk = struct {
    id: []const u8,
    object: []const u8 = "chat.completion.chunk",
    created: u64 = created,
    model: []const u8,
    choices: []const ChunkChoice,
    usage: ?Usage = null,
    prompt_token_ids: ?[]const u32 = null,
};
const TextChoice = struct {
    index: u32,
    text: []const u8,
    logprobs: Value = .null,
    finish_reason: Value,
    stop_reason: Value = .null,
    token_ids: ?[]const u32 = null,
    prompt_token_ids: ?[]const u32 = null,
};
const TextResponse = struct {
    id: []const u8,
    object: []const u8 = "text_completion",
    created: u64 = created,
    model: []const u8,
    choices: []const TextChoice,
    usage: ?Usage = null,
};

/// Optional fields left out when null (a `Value` field is written even when it is null).
const json_options: std.json.Stringify.Options = .{ .emit_null_optional_fields = false };

/// A body of server-sent events: "data: {json}\n\n" ... "data: [DONE]\n\n".
const Sse = struct {
    out: std.Io.Writer.Allocating,

    fn init(arena: Allocator) Sse {
        return .{ .out = .init(arena) };
    }

    fn event(s: *Sse, v: anytype) !void {
        try s.out.writer.writeAll("data: ");
        try std.json.Stringify.value(v, json_options, &s.out.writer);
        try s.out.writer.writeAll("\n\n");
    }

    fn done(s: *Sse) !Response {
        try s.out.writer.writeAll("data: [DONE]\n\n");
        return .{ .status = .ok, .body = s.out.written(), .content_type = "text/event-stream" };
    }
};

fn jsonResponse(arena: Allocator, v: anytype) !Response {
    return .{ .status = .ok, .body = try std.json.Stringify.valueAlloc(arena, v, json_options) };
}

fn idsOrNull(arena: Allocator, on: bool, tokens: []const model.Token) !?[]const u32 {
    return if (on) try model.ids(arena, tokens) else null;
}

/// The first `max` tokens of `tokens`; `finish` is "length" when that cut any.
fn truncate(tokens: []const model.Token, max: usize, finish: *[]const u8) []const model.Token {
    if (tokens.len > max) {
        finish.* = "length";
        return tokens[0..max];
    }
    return tokens;
}

// ------------------------------------------------------------------------------ chat completions

const Role = enum { system, developer, user, assistant, tool };

const Turn = struct {
    role: Role,
    text: []const u8,
    calls: []const model.ToolCall = &.{},
    tool_call_id: []const u8 = "",
};

const Tool = struct { name: []const u8, parameters: ?Value };

/// What the model answers to one chat request.
const ChatAnswer = struct {
    reasoning: ?[]const u8 = null,
    /// null: the answer is a tool call
    content: ?[]const u8 = null,
    call: ?model.ToolCall = null,
    /// The completion's tokens: the content's, or the tool call's (model.ToolCall.generated).
    tokens: []const model.Token,
    finish: []const u8,
};

fn parseTurns(arena: Allocator, req: ObjectMap, bad: *?[]const u8) ![]Turn {
    const msgs = field(req, "messages") orelse return fail(bad, "messages: required");
    if (msgs != .array or msgs.array.items.len == 0) return fail(bad, "messages: expected a non-empty list");
    const turns = try arena.alloc(Turn, msgs.array.items.len);
    for (msgs.array.items, turns) |m, *t| {
        if (m != .object) return fail(bad, "messages: each message must be an object");
        const role_v = field(m.object, "role") orelse return fail(bad, "messages: a message has no role");
        if (role_v != .string) return fail(bad, "messages: role must be a string");
        const role = std.meta.stringToEnum(Role, role_v.string) orelse
            return fail(bad, "messages: role must be system, developer, user, assistant or tool");
        t.* = .{ .role = role, .text = try contentText(arena, m.object.get("content"), bad) };
        if (role == .tool) {
            if (field(m.object, "tool_call_id")) |id| if (id == .string) {
                t.tool_call_id = id.string;
            };
        }
        if (role == .assistant) if (field(m.object, "tool_calls")) |tc| {
            if (tc != .array) return fail(bad, "messages: tool_calls must be a list");
            const calls = try arena.alloc(model.ToolCall, tc.array.items.len);
            for (tc.array.items, calls) |c, *out| {
                if (c != .object) return fail(bad, "messages: a tool call must be an object");
                const f = field(c.object, "function") orelse return fail(bad, "messages: a tool call has no function");
                if (f != .object) return fail(bad, "messages: a tool call's function must be an object");
                const name = field(f.object, "name") orelse Value{ .string = "" };
                const args = field(f.object, "arguments") orelse Value{ .string = "{}" };
                const id = field(c.object, "id") orelse Value{ .string = "" };
                out.* = .{
                    .id = if (id == .string) id.string else "",
                    .name = if (name == .string) name.string else "",
                    // arguments are JSON text; an object given as JSON is taken too
                    .arguments = if (args == .string) args.string else try std.json.Stringify.valueAlloc(arena, args, .{}),
                    .generated = "",
                };
            }
            t.calls = calls;
        };
    }
    return turns;
}

fn parseTools(arena: Allocator, req: ObjectMap, bad: *?[]const u8) ![]Tool {
    const v = field(req, "tools") orelse return &.{};
    if (v != .array) return fail(bad, "tools: expected a list");
    const tools = try arena.alloc(Tool, v.array.items.len);
    for (v.array.items, tools) |t, *out| {
        if (t != .object) return fail(bad, "tools: each tool must be an object");
        const f = field(t.object, "function") orelse return fail(bad, "tools: a tool has no function");
        if (f != .object) return fail(bad, "tools: a tool's function must be an object");
        const name = field(f.object, "name") orelse return fail(bad, "tools: a function has no name");
        if (name != .string) return fail(bad, "tools: a function's name must be a string");
        out.* = .{ .name = name.string, .parameters = field(f.object, "parameters") };
    }
    return tools;
}

const Choice = union(enum) { auto, none, required, named: []const u8 };

fn parseToolChoice(req: ObjectMap, bad: *?[]const u8) Bad!Choice {
    const v = field(req, "tool_choice") orelse return .auto;
    switch (v) {
        .string => |s| {
            if (std.mem.eql(u8, s, "auto")) return .auto;
            if (std.mem.eql(u8, s, "none")) return .none;
            if (std.mem.eql(u8, s, "required")) return .required;
            return fail(bad, "tool_choice: expected \"auto\", \"none\", \"required\" or a named function");
        },
        .object => |o| {
            const f = field(o, "function") orelse return fail(bad, "tool_choice: a named choice needs a function");
            if (f != .object) return fail(bad, "tool_choice: function must be an object");
            const name = field(f.object, "name") orelse return fail(bad, "tool_choice: function needs a name");
            if (name != .string) return fail(bad, "tool_choice: the function's name must be a string");
            return .{ .named = name.string };
        },
        else => return fail(bad, "tool_choice: expected a string or an object"),
    }
}

/// chat_template_kwargs.thinking (or enable_thinking): true turns thinking on for this request.
fn thinkingOn(req: ObjectMap, bad: *?[]const u8) Bad!bool {
    const kw = field(req, "chat_template_kwargs") orelse return false;
    if (kw != .object) return fail(bad, "chat_template_kwargs: expected an object");
    if (field(kw.object, "thinking")) |t| if (t == .bool) return t.bool;
    if (field(kw.object, "enable_thinking")) |t| if (t == .bool) return t.bool;
    return false;
}

/// The prompt the model "reads": a plain rendering of the tools and turns (its tokens are the
/// prompt's token ids; its hash names the completion).
fn renderPrompt(arena: Allocator, tools: []const Tool, turns: []const Turn, thinking: bool) ![]const u8 {
    var out: std.ArrayList(u8) = .empty;
    for (tools) |t| try out.print(arena, "<|tool|> {s}\n", .{t.name});
    for (turns) |t| {
        try out.print(arena, "<|{t}|> {s}", .{ t.role, t.text });
        for (t.calls) |c| try out.print(arena, " {s} {s}", .{ c.name, c.arguments });
        try out.append(arena, '\n');
    }
    try out.appendSlice(arena, if (thinking) "<|assistant|> <think>" else "<|assistant|>");
    return out.items;
}

fn answerChat(arena: Allocator, turns: []const Turn, tools: []const Tool, choice: Choice, thinking: bool, c: Common, fault: Fault, bad: *?[]const u8) !ChatAnswer {
    if (fault == .garbage_token) {
        const toks = try model.garbage(arena, @min(c.max_tokens, garbage_max));
        return .{ .content = try model.join(arena, toks), .tokens = toks, .finish = "length" };
    }
    var prompt: []const u8 = "";
    var i = turns.len;
    while (i > 0) : (i -= 1) if (turns[i - 1].role == .user) {
        prompt = turns[i - 1].text;
        break;
    };
    const last = turns[turns.len - 1];
    var finish: []const u8 = "stop";

    // A tool call: tools offered, not refused, and the user just spoke.
    if (tools.len > 0 and choice != .none and last.role == .user) {
        const tool = if (choice == .named) for (tools) |t| {
            if (std.mem.eql(u8, t.name, choice.named)) break t;
        } else return fail(bad, "tool_choice: the named function is not in tools") else tools[0];
        const call = try model.toolCall(arena, prompt, tool.name, tool.parameters);
        return .{
            .reasoning = if (thinking) try model.reasoning(arena, prompt, try std.fmt.allocPrint(arena, "I call {s}.", .{tool.name})) else null,
            .call = call,
            .tokens = try model.tokenize(arena, call.generated),
            .finish = "tool_calls",
        };
    }

    var content: []const u8 = undefined;
    var reasoning: []const u8 = undefined;
    if (last.role == .tool) {
        // The results of the calls the assistant made: every tool message at the end, in order.
        var first = turns.len - 1;
        while (first > 0 and turns[first - 1].role == .tool) first -= 1;
        var text: std.ArrayList(u8) = .empty;
        var names: std.ArrayList(u8) = .empty;
        for (turns[first..], 0..) |t, k| {
            const call = findCall(turns[0..first], t.tool_call_id, k);
            const name = if (call) |cl| cl.name else "";
            if (text.items.len > 0) try text.append(arena, ' ');
            try text.appendSlice(arena, try model.toolResultSentence(arena, name, if (call) |cl| cl.arguments else "", t.text));
            if (names.items.len > 0) try names.appendSlice(arena, ", ");
            try names.appendSlice(arena, if (name.len > 0) name else "the tool");
        }
        content = text.items;
        reasoning = try std.fmt.allocPrint(arena, "The user asks: {s} {s} answered. I report its result.", .{ prompt, names.items });
    } else {
        content = try model.answer(arena, prompt);
        reasoning = try model.reasoning(arena, prompt, "I answer directly.");
    }
    const toks = truncate(try model.tokenize(arena, content), c.max_tokens, &finish);
    return .{
        .reasoning = if (thinking) reasoning else null,
        .content = try model.join(arena, toks),
        .tokens = toks,
        .finish = finish,
    };
}

/// The call a tool message answers: the one with its tool_call_id in the last assistant message
/// with calls, else that message's k-th call.
fn findCall(turns: []const Turn, id: []const u8, k: usize) ?model.ToolCall {
    var i = turns.len;
    while (i > 0) : (i -= 1) {
        const t = turns[i - 1];
        if (t.role != .assistant or t.calls.len == 0) continue;
        for (t.calls) |c| if (id.len > 0 and std.mem.eql(u8, c.id, id)) return c;
        return if (k < t.calls.len) t.calls[k] else null;
    }
    return null;
}

fn chatCompletion(arena: Allocator, req: ObjectMap, api: *const Api, bad: *?[]const u8) !Response {
    const c = try commonFields(req, bad);
    const turns = try parseTurns(arena, req, bad);
    const tools = try parseTools(arena, req, bad);
    const choice = try parseToolChoice(req, bad);
    const thinking = try thinkingOn(req, bad);
    const rendered = try renderPrompt(arena, tools, turns, thinking);
    const prompt_ids = try model.ids(arena, try model.tokenize(arena, rendered));
    const ans = try answerChat(arena, turns, tools, choice, thinking, c, api.fault, bad);
    const id = try std.fmt.allocPrint(arena, "chatcmpl-{x:0>16}", .{model.fnv1a64(rendered)});
    const usage: Usage = .{
        .prompt_tokens = prompt_ids.len,
        .completion_tokens = ans.tokens.len,
        .total_tokens = prompt_ids.len + ans.tokens.len,
    };
    const call_out: ?[]const ToolCallOut = if (ans.call) |call| try arena.dupe(ToolCallOut, &.{.{
        .id = call.id,
        .function = .{ .name = call.name, .arguments = call.arguments },
    }}) else null;

    if (!c.stream) {
        return jsonResponse(arena, ChatResponse{
            .id = id,
            .model = api.served_name,
            .choices = &.{.{
                .message = .{
                    .content = if (ans.content) |s| .{ .string = s } else .null,
                    .reasoning_content = ans.reasoning,
                    .tool_calls = call_out,
                },
                .finish_reason = ans.finish,
                .token_ids = try idsOrNull(arena, c.return_ids, ans.tokens),
            }},
            .usage = usage,
            .prompt_token_ids = if (c.return_ids) prompt_ids else null,
        });
    }

    // Streamed: the role, the reasoning a token a chunk, then the content a token a chunk (or the
    // tool call in one delta), then the finish reason; token_ids on every chunk when asked for.
    const no_ids: ?[]const u32 = if (c.return_ids) &.{} else null;
    var sse: Sse = .init(arena);
    const Chunk = struct {
        fn one(s: *Sse, cid: []const u8, name: []const u8, delta: Delta, finish: Value, token_ids: ?[]const u32, pids: ?[]const u32) !void {
            try s.event(ChatChunk{
                .id = cid,
                .model = name,
                .choices = &.{.{ .delta = delta, .finish_reason = finish, .token_ids = token_ids }},
                .prompt_token_ids = pids,
            });
        }
    };
    try Chunk.one(&sse, id, api.served_name, .{ .role = "assistant", .content = "" }, .null, no_ids, if (c.return_ids) prompt_ids else null);
    if (ans.reasoning) |r| for (try model.tokenize(arena, r)) |t| {
        try Chunk.one(&sse, id, api.served_name, .{ .reasoning_content = t.text }, .null, no_ids, null);
    };
    if (ans.call) |call| {
        const delta: Delta = .{ .tool_calls = try arena.dupe(ToolCallDelta, &.{.{
            .id = call.id,
            .function = .{ .name = call.name, .arguments = call.arguments },
        }}) };
        try Chunk.one(&sse, id, api.served_name, delta, .null, try idsOrNull(arena, c.return_ids, ans.tokens), null);
    } else for (ans.tokens) |t| {
        const one_id: ?[]const u32 = if (c.return_ids) try arena.dupe(u32, &.{t.id}) else null;
        try Chunk.one(&sse, id, api.served_name, .{ .content = t.text }, .null, one_id, null);
    }
    try Chunk.one(&sse, id, api.served_name, .{}, .{ .string = ans.finish }, no_ids, null);
    if (c.include_usage) try sse.event(ChatChunk{ .id = id, .model = api.served_name, .choices = &.{}, .usage = usage });
    return sse.done();
}

// ------------------------------------------------------------------------------ raw completions

const RawPrompt = struct { text: []const u8, ids: []const u32 };

fn parsePrompts(arena: Allocator, req: ObjectMap, bad: *?[]const u8) ![]RawPrompt {
    const p = field(req, "prompt") orelse return fail(bad, "prompt: required");
    const one = struct {
        fn fromText(a: Allocator, s: []const u8) !RawPrompt {
            return .{ .text = s, .ids = try model.ids(a, try model.tokenize(a, s)) };
        }
        /// A prompt of token ids: the model reads their decimal text.
        fn fromIds(a: Allocator, items: []const Value, b: *?[]const u8) !RawPrompt {
            const ids = try a.alloc(u32, items.len);
            var text: std.ArrayList(u8) = .empty;
            for (items, ids) |v, *o| {
                if (v != .integer or v.integer < 0 or v.integer > std.math.maxInt(u32)) return fail(b, "prompt: token ids must be non-negative integers");
                o.* = @intCast(v.integer);
                try text.print(a, "{s}{d}", .{ if (text.items.len > 0) " " else "", v.integer });
            }
            return .{ .text = text.items, .ids = ids };
        }
    };
    switch (p) {
        .string => |s| return try arena.dupe(RawPrompt, &.{try one.fromText(arena, s)}),
        .array => |a| {
            if (a.items.len == 0) return fail(bad, "prompt: an empty list");
            if (a.items[0] == .integer) return try arena.dupe(RawPrompt, &.{try one.fromIds(arena, a.items, bad)});
            const out = try arena.alloc(RawPrompt, a.items.len);
            for (a.items, out) |item, *o| o.* = switch (item) {
                .string => |s| try one.fromText(arena, s),
                .array => |ids| try one.fromIds(arena, ids.items, bad),
                else => return fail(bad, "prompt: expected a string, a list of strings or token ids"),
            };
            return out;
        },
        else => return fail(bad, "prompt: expected a string, a list of strings or token ids"),
    }
}

fn textCompletion(arena: Allocator, req: ObjectMap, api: *const Api, bad: *?[]const u8) !Response {
    const c = try commonFields(req, bad);
    const prompts = try parsePrompts(arena, req, bad);
    var h: u64 = model.fnv1a64("completion");
    for (prompts) |p| h = (h ^ model.fnv1a64(p.text)) *% 0x100000001b3;
    const id = try std.fmt.allocPrint(arena, "cmpl-{x:0>16}", .{h});
    const outs = try arena.alloc([]const model.Token, prompts.len);
    const finishes = try arena.alloc([]const u8, prompts.len);
    var usage: Usage = .{ .prompt_tokens = 0, .completion_tokens = 0, .total_tokens = 0 };
    for (prompts, outs, finishes) |p, *o, *f| {
        f.* = "stop";
        if (api.fault == .garbage_token) {
            o.* = try model.garbage(arena, @min(c.max_tokens, garbage_max));
            f.* = "length";
        } else {
            o.* = truncate(try model.tokenize(arena, try model.answer(arena, p.text)), c.max_tokens, f);
        }
        usage.prompt_tokens += p.ids.len;
        usage.completion_tokens += o.len;
    }
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens;

    if (!c.stream) {
        const choices = try arena.alloc(TextChoice, prompts.len);
        for (choices, prompts, outs, finishes, 0..) |*ch, p, o, f, i| ch.* = .{
            .index = @intCast(i),
            .text = try model.join(arena, o),
            .finish_reason = .{ .string = f },
            .token_ids = try idsOrNull(arena, c.return_ids, o),
            .prompt_token_ids = if (c.return_ids) p.ids else null,
        };
        return jsonResponse(arena, TextResponse{ .id = id, .model = api.served_name, .choices = choices, .usage = usage });
    }
    var sse: Sse = .init(arena);
    for (prompts, outs, finishes, 0..) |p, o, f, i| {
        for (o, 0..) |t, k| try sse.event(TextResponse{ .id = id, .model = api.served_name, .choices = &.{.{
            .index = @intCast(i),
            .text = t.text,
            .finish_reason = .null,
            .token_ids = if (c.return_ids) try arena.dupe(u32, &.{t.id}) else null,
            .prompt_token_ids = if (c.return_ids and k == 0) p.ids else null,
        }} });
        try sse.event(TextResponse{ .id = id, .model = api.served_name, .choices = &.{.{
            .index = @intCast(i),
            .text = "",
            .finish_reason = .{ .string = f },
            .token_ids = if (c.return_ids) &.{} else null,
            .prompt_token_ids = if (c.return_ids and o.len == 0) p.ids else null,
        }} });
    }
    if (c.include_usage) try sse.event(TextResponse{ .id = id, .model = api.served_name, .choices = &.{}, .usage = usage });
    return sse.done();
}

// ------------------------------------------------------------------------------ serving

/// Listen on host:port (refusing when it cannot) and serve forever, one task per connection.
/// SIM_FAULT is read here (main.zig has already refused an unknown one).
pub fn serve(ctx: *const Ctx, host: []const u8, port: u16, api_in: *const Api) noreturn {
    const io = ctx.io;
    var with_fault = api_in.*;
    with_fault.fault = faultFromEnv(ctx);
    const api = &with_fault;
    if (api.fault == .garbage_token)
        ctx.log("SIM_FAULT=garbage-token: every completion answers one token repeated", .{});
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
            .extra_headers = &.{
                .{ .name = "content-type", .value = resp.content_type },
                .{ .name = "cache-control", .value = "no-cache" },
            },
        });
        if (!keep_alive) return;
    }
}

// ------------------------------------------------------------------------------ tests

const testing = std.testing;

const TestApi = struct {
    arena_state: std.heap.ArenaAllocator,
    api: Api = .{ .served_name = "m", .owned_by = "sim", .registry = null },

    fn init() TestApi {
        return .{ .arena_state = .init(testing.allocator) };
    }
    fn deinit(t: *TestApi) void {
        t.arena_state.deinit();
    }
    fn a(t: *TestApi) Allocator {
        return t.arena_state.allocator();
    }
    /// POST `body` to `path`; the response, checked 200.
    fn post(t: *TestApi, path: []const u8, body: []const u8) !Response {
        const r = try route(t.a(), .POST, path, body, &t.api);
        if (r.status != .ok) {
            std.debug.print("{s} -> {d}: {s}\n", .{ path, @backingInt(r.status), r.body });
            return error.TestUnexpectedResult;
        }
        return r;
    }
    fn chat(t: *TestApi, body: []const u8) !Value {
        const r = try t.post("/v1/chat/completions", body);
        try testing.expectEqualStrings("application/json", r.content_type);
        return std.json.parseFromSliceLeaky(Value, t.a(), r.body, .{});
    }
    fn stream(t: *TestApi, path: []const u8, body: []const u8) !Streamed {
        const r = try t.post(path, body);
        try testing.expectEqualStrings("text/event-stream", r.content_type);
        return Streamed.parse(t.a(), r.body);
    }
};

/// A streamed body, its chunks joined as a client joins them.
const Streamed = struct {
    content: []const u8,
    reasoning: []const u8,
    tool_name: []const u8,
    tool_args: []const u8,
    tool_id: []const u8,
    ids: []const i64,
    finish: []const u8,
    chunks: usize,
    usage: ?Value,
    prompt_ids: ?Value,

    fn parse(a: Allocator, body: []const u8) !Streamed {
        try testing.expect(std.mem.endsWith(u8, body, "data: [DONE]\n\n"));
        var content: std.ArrayList(u8) = .empty;
        var reasoning: std.ArrayList(u8) = .empty;
        var ids: std.ArrayList(i64) = .empty;
        var s: Streamed = undefined;
        s.tool_name = "";
        s.tool_args = "";
        s.tool_id = "";
        s.finish = "";
        s.chunks = 0;
        s.usage = null;
        s.prompt_ids = null;
        var events = std.mem.splitSequence(u8, body[0 .. body.len - "data: [DONE]\n\n".len], "\n\n");
        while (events.next()) |ev| {
            if (ev.len == 0) continue;
            try testing.expect(std.mem.startsWith(u8, ev, "data: "));
            const v = try std.json.parseFromSliceLeaky(Value, a, ev["data: ".len..], .{});
            s.chunks += 1;
            if (v.object.get("usage")) |u| s.usage = u;
            if (v.object.get("prompt_token_ids")) |p| s.prompt_ids = p;
            for (v.object.get("choices").?.array.items) |ch| {
                const f = ch.object.get("finish_reason").?;
                if (f == .string) {
                    try testing.expectEqualStrings("", s.finish); // only the last chunk has one
                    s.finish = f.string;
                }
                if (ch.object.get("token_ids")) |tids| for (tids.array.items) |x| try ids.append(a, x.integer);
                if (ch.object.get("text")) |t| try content.appendSlice(a, t.string);
                const d = ch.object.get("delta") orelse continue;
                if (d.object.get("content")) |t| try content.appendSlice(a, t.string);
                if (d.object.get("reasoning_content")) |t| {
                    try testing.expectEqual(@as(usize, 0), content.items.len); // reasoning first
                    try reasoning.appendSlice(a, t.string);
                }
                if (d.object.get("tool_calls")) |tc| {
                    const c0 = tc.array.items[0].object;
                    try testing.expectEqual(@as(i64, 0), c0.get("index").?.integer);
                    s.tool_id = c0.get("id").?.string;
                    try testing.expectEqualStrings("function", c0.get("type").?.string);
                    s.tool_name = c0.get("function").?.object.get("name").?.string;
                    s.tool_args = c0.get("function").?.object.get("arguments").?.string;
                }
            }
        }
        s.content = content.items;
        s.reasoning = reasoning.items;
        s.ids = ids.items;
        return s;
    }
};

fn choice0(v: Value) ObjectMap {
    return v.object.get("choices").?.array.items[0].object;
}

fn intsOf(a: Allocator, v: Value) ![]const i64 {
    var out: std.ArrayList(i64) = .empty;
    for (v.array.items) |x| try out.append(a, x.integer);
    return out.items;
}

test "health follows the registry" {
    var arena_state: std.heap.ArenaAllocator = .init(testing.allocator);
    defer arena_state.deinit();
    const a = arena_state.allocator();
    var reg: rendezvous.Registry = .{ .ctx = undefined, .family = .vllm, .world = 2, .port = 1 };
    const api: Api = .{ .served_name = "m", .owned_by = "sim", .registry = &reg };
    const h1 = try route(a, .GET, "/health", "", &api);
    try testing.expectEqual(std.http.Status.service_unavailable, h1.status);
    try testing.expectEqualStrings("{\"status\":\"loading\",\"joined\":1,\"world\":2}", h1.body);
    const c1 = try route(a, .POST, "/v1/completions", "{}", &api);
    try testing.expectEqual(std.http.Status.service_unavailable, c1.status);
    const c1c = try route(a, .POST, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", &api);
    try testing.expectEqual(std.http.Status.service_unavailable, c1c.status);
    _ = reg.mask.fetchOr(2, .acq_rel);
    const h2 = try route(a, .GET, "/health", "", &api);
    try testing.expectEqual(std.http.Status.ok, h2.status);
    try testing.expectEqualStrings("{\"status\":\"ok\"}", h2.body);
    const c2 = try route(a, .POST, "/v1/completions", "{\"prompt\":\"17*19=\"}", &api);
    try testing.expect(std.mem.indexOf(u8, c2.body, "\"text\":\"323\"") != null);
}

test "bad requests are 400" {
    var t: TestApi = .init();
    defer t.deinit();
    for ([_][]const u8{
        "not json",
        "[1]",
        "{}",
        "{\"messages\":[]}",
        "{\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":0}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":\"yes\"}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}}",
    }) |body| {
        const r = try route(t.a(), .POST, "/v1/chat/completions", body, &t.api);
        try testing.expectEqual(std.http.Status.bad_request, r.status);
    }
    const r = try route(t.a(), .POST, "/v1/completions", "{\"max_tokens\":1}", &t.api);
    try testing.expectEqual(std.http.Status.bad_request, r.status);
    try testing.expectEqual(std.http.Status.not_found, (try route(t.a(), .GET, "/nope", "", &t.api)).status);
}

test "a known prompt: content, ids, usage" {
    var t: TestApi = .init();
    defer t.deinit();
    const v = try t.chat(
        \\{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"17*19="}],
        \\ "temperature":0,"max_tokens":16,"return_token_ids":true,"some_unknown_field":{"x":1}}
    );
    try testing.expectEqualStrings("chat.completion", v.object.get("object").?.string);
    try testing.expectEqualStrings("m", v.object.get("model").?.string);
    const ch = choice0(v);
    const msg = ch.get("message").?.object;
    try testing.expectEqualStrings("assistant", msg.get("role").?.string);
    try testing.expectEqualStrings("323", msg.get("content").?.string);
    try testing.expect(msg.get("reasoning_content") == null and msg.get("tool_calls") == null);
    try testing.expectEqualStrings("stop", ch.get("finish_reason").?.string);
    const ids = try intsOf(t.a(), ch.get("token_ids").?);
    try testing.expectEqualSlices(i64, &.{model.tokenId("323")}, ids);
    const usage = v.object.get("usage").?.object;
    try testing.expectEqual(@as(i64, 1), usage.get("completion_tokens").?.integer);
    const pids = v.object.get("prompt_token_ids").?.array.items;
    try testing.expectEqual(@as(i64, @intCast(pids.len)), usage.get("prompt_tokens").?.integer);
    try testing.expect(pids.len > 3);

    // the other known prompts
    inline for (.{ .{ "Say OK.", "OK" }, .{ "What is the capital of France?", "Paris" }, .{ "Name a colour.", "blue" }, .{ "17*23=", "391" } }) |kv| {
        const w = try t.chat("{\"messages\":[{\"role\":\"user\",\"content\":\"" ++ kv[0] ++ "\"}]}");
        try testing.expectEqualStrings(kv[1], choice0(w).get("message").?.object.get("content").?.string);
        try testing.expect(choice0(w).get("token_ids") == null and w.object.get("prompt_token_ids") == null);
    }
    // max_tokens cuts: "length"; the default is 64
    const count = try t.chat("{\"messages\":[{\"role\":\"user\",\"content\":\"Count from 1 to 100, separated by spaces.\"}],\"max_tokens\":5,\"return_token_ids\":true}");
    try testing.expectEqualStrings("1 2 3 4 5", choice0(count).get("message").?.object.get("content").?.string);
    try testing.expectEqualStrings("length", choice0(count).get("finish_reason").?.string);
    try testing.expectEqual(@as(usize, 5), choice0(count).get("token_ids").?.array.items.len);
    const dflt = try t.chat("{\"messages\":[{\"role\":\"user\",\"content\":\"Count from 1 to 100, separated by spaces.\"}]}");
    try testing.expectEqual(@as(i64, 64), dflt.object.get("usage").?.object.get("completion_tokens").?.integer);
    const twenty = try t.chat("{\"messages\":[{\"role\":\"user\",\"content\":\"Count from one to twenty.\"}]}");
    try testing.expectEqualStrings("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", choice0(twenty).get("message").?.object.get("content").?.string);
    // the same request: the same bytes
    const body = "{\"messages\":[{\"role\":\"user\",\"content\":\"Tell me about rivers.\"}],\"return_token_ids\":true}";
    const r1 = try t.post("/v1/chat/completions", body);
    const r2 = try t.post("/v1/chat/completions", body);
    try testing.expectEqualStrings(r1.body, r2.body);
}

test "streamed equals non-streamed: content and token ids" {
    var t: TestApi = .init();
    defer t.deinit();
    inline for (.{ "17*19=", "Count from one to twenty.", "Tell me about rivers.", "What is the capital of France?" }) |p| {
        const base = "{\"messages\":[{\"role\":\"user\",\"content\":\"" ++ p ++ "\"}],\"max_tokens\":12,\"return_token_ids\":true";
        const plain = try t.chat(base ++ "}");
        const s = try t.stream("/v1/chat/completions", base ++ ",\"stream\":true,\"stream_options\":{\"include_usage\":true}}");
        const ch = choice0(plain);
        try testing.expectEqualStrings(ch.get("message").?.object.get("content").?.string, s.content);
        try testing.expectEqualSlices(i64, try intsOf(t.a(), ch.get("token_ids").?), s.ids);
        try testing.expectEqualStrings(ch.get("finish_reason").?.string, s.finish);
        try testing.expectEqualStrings("", s.reasoning);
        try testing.expect(s.chunks >= s.ids.len + 2);
        try testing.expectEqual(@as(i64, @intCast(s.ids.len)), s.usage.?.object.get("completion_tokens").?.integer);
        try testing.expectEqual(plain.object.get("prompt_token_ids").?.array.items.len, s.prompt_ids.?.array.items.len);
    }
    // raw completions, too
    const plain = try t.post("/v1/completions", "{\"prompt\":\"Count from one to twenty.\",\"max_tokens\":7,\"return_token_ids\":true}");
    const pv = try std.json.parseFromSliceLeaky(Value, t.a(), plain.body, .{});
    const s = try t.stream("/v1/completions", "{\"prompt\":\"Count from one to twenty.\",\"max_tokens\":7,\"return_token_ids\":true,\"stream\":true}");
    try testing.expectEqualStrings("1 2 3 4 5 6 7", choice0(pv).get("text").?.string);
    try testing.expectEqualStrings("1 2 3 4 5 6 7", s.content);
    try testing.expectEqualSlices(i64, try intsOf(t.a(), choice0(pv).get("token_ids").?), s.ids);
    try testing.expectEqualStrings("length", s.finish);
    try testing.expect(choice0(pv).get("prompt_token_ids") != null);
}

const weather_tools =
    \\"tools":[{"type":"function","function":{"name":"get_weather","description":"Weather of a city",
    \\"parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}},
    \\{"type":"function","function":{"name":"other","parameters":{"type":"object"}}}]
;

test "a tool call, plain and streamed" {
    var t: TestApi = .init();
    defer t.deinit();
    const base = "{\"messages\":[{\"role\":\"user\",\"content\":\"What is the weather in Paris?\"}]," ++ weather_tools ++
        ",\"tool_choice\":\"auto\",\"return_token_ids\":true";
    const v = try t.chat(base ++ "}");
    const ch = choice0(v);
    try testing.expectEqualStrings("tool_calls", ch.get("finish_reason").?.string);
    const msg = ch.get("message").?.object;
    try testing.expect(msg.get("content").? == .null);
    const call = msg.get("tool_calls").?.array.items[0].object;
    const id = call.get("id").?.string;
    try testing.expect(std.mem.startsWith(u8, id, "call_"));
    try testing.expectEqualStrings("function", call.get("type").?.string);
    const f = call.get("function").?.object;
    try testing.expectEqualStrings("get_weather", f.get("name").?.string);
    try testing.expectEqualStrings("{\"city\": \"Paris\"}", f.get("arguments").?.string);
    const ids = try intsOf(t.a(), ch.get("token_ids").?);
    try testing.expect(ids.len > 0);
    try testing.expectEqual(@as(i64, @intCast(ids.len)), v.object.get("usage").?.object.get("completion_tokens").?.integer);

    const s = try t.stream("/v1/chat/completions", base ++ ",\"stream\":true}");
    try testing.expectEqualStrings("tool_calls", s.finish);
    try testing.expectEqualStrings("get_weather", s.tool_name);
    try testing.expectEqualStrings("{\"city\": \"Paris\"}", s.tool_args);
    try testing.expectEqualStrings(id, s.tool_id);
    try testing.expectEqualStrings("", s.content);
    try testing.expectEqualSlices(i64, ids, s.ids);

    // tool_choice "none": a plain answer; a named function: that one
    const none = try t.chat("{\"messages\":[{\"role\":\"user\",\"content\":\"17*19=\"}]," ++ weather_tools ++ ",\"tool_choice\":\"none\"}");
    try testing.expectEqualStrings("323", choice0(none).get("message").?.object.get("content").?.string);
    const named = try t.chat("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]," ++ weather_tools ++
        ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"other\"}}}");
    try testing.expectEqualStrings("other", choice0(named).get("message").?.object.get("tool_calls").?.array.items[0].object.get("function").?.object.get("name").?.string);
}

test "a turn after a tool result uses the result" {
    var t: TestApi = .init();
    defer t.deinit();
    const body = "{\"messages\":[{\"role\":\"user\",\"content\":\"What is the weather in Paris?\"}," ++
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"call_gate0\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}}]}," ++
        "{\"role\":\"tool\",\"tool_call_id\":\"call_gate0\",\"content\":\"{\\\"condition\\\": \\\"sunny\\\", \\\"temperature\\\": 21, \\\"unit\\\": \\\"C\\\"}\"}]," ++
        weather_tools ++ ",\"tool_choice\":\"auto\",\"return_token_ids\":true}";
    const v = try t.chat(body);
    const ch = choice0(v);
    try testing.expectEqualStrings("stop", ch.get("finish_reason").?.string);
    const content = ch.get("message").?.object.get("content").?.string;
    try testing.expectEqualStrings("The weather for Paris is sunny, 21, C.", content);
    try testing.expect(ch.get("message").?.object.get("tool_calls") == null);
    const s = try t.stream("/v1/chat/completions", body[0 .. body.len - 1] ++ ",\"stream\":true}");
    try testing.expectEqualStrings(content, s.content);
}

test "reasoning on and off" {
    var t: TestApi = .init();
    defer t.deinit();
    const base = "{\"messages\":[{\"role\":\"user\",\"content\":\"17*19=\"}],\"return_token_ids\":true";
    const off = try t.chat(base ++ ",\"chat_template_kwargs\":{\"thinking\":false}}");
    const absent = try t.chat(base ++ "}");
    const on = try t.chat(base ++ ",\"chat_template_kwargs\":{\"thinking\":true}}");
    for ([_]Value{ off, absent }) |v| try testing.expect(choice0(v).get("message").?.object.get("reasoning_content") == null);
    const msg = choice0(on).get("message").?.object;
    try testing.expectEqualStrings("The user asks: 17*19=. I answer directly.", msg.get("reasoning_content").?.string);
    try testing.expectEqualStrings("323", msg.get("content").?.string);
    // the ids are the content's: the same with or without thinking
    try testing.expectEqualSlices(i64, try intsOf(t.a(), choice0(off).get("token_ids").?), try intsOf(t.a(), choice0(on).get("token_ids").?));
    const s = try t.stream("/v1/chat/completions", base ++ ",\"chat_template_kwargs\":{\"thinking\":true},\"stream\":true}");
    try testing.expectEqualStrings("The user asks: 17*19=. I answer directly.", s.reasoning);
    try testing.expectEqualStrings("323", s.content);
    try testing.expectEqualSlices(i64, try intsOf(t.a(), choice0(on).get("token_ids").?), s.ids);
    const s_off = try t.stream("/v1/chat/completions", base ++ ",\"stream\":true}");
    try testing.expectEqualStrings("", s_off.reasoning);
}

test "draft false answers exactly as draft true" {
    var t: TestApi = .init();
    defer t.deinit();
    inline for (.{ "17*19=", "Count from 1 to 100, separated by spaces.", "Write a haiku." }) |p| {
        const base = "{\"messages\":[{\"role\":\"user\",\"content\":\"" ++ p ++ "\"}],\"return_token_ids\":true,\"max_tokens\":32";
        const d1 = try t.post("/v1/chat/completions", base ++ ",\"draft\":true}");
        const d0 = try t.post("/v1/chat/completions", base ++ ",\"draft\":false}");
        const plain = try t.post("/v1/chat/completions", base ++ "}");
        try testing.expectEqualStrings(d1.body, d0.body);
        try testing.expectEqualStrings(plain.body, d0.body);
    }
}

test "SIM_FAULT garbage-token: one token repeated" {
    var t: TestApi = .init();
    defer t.deinit();
    t.api.fault = .garbage_token;
    const base = "{\"messages\":[{\"role\":\"user\",\"content\":\"17*19=\"}],\"return_token_ids\":true,\"max_tokens\":16," ++
        weather_tools ++ ",\"chat_template_kwargs\":{\"thinking\":true}";
    const v = try t.chat(base ++ "}");
    const ch = choice0(v);
    try testing.expectEqualStrings("length", ch.get("finish_reason").?.string);
    try testing.expectEqualStrings("!!!!!!!!!!!!!!!!", ch.get("message").?.object.get("content").?.string);
    try testing.expect(ch.get("message").?.object.get("tool_calls") == null);
    const ids = try intsOf(t.a(), ch.get("token_ids").?);
    try testing.expectEqual(@as(usize, 16), ids.len);
    for (ids) |x| try testing.expectEqual(ids[0], x);
    const s = try t.stream("/v1/chat/completions", base ++ ",\"stream\":true}");
    try testing.expectEqualStrings("!!!!!!!!!!!!!!!!", s.content);
    try testing.expectEqualSlices(i64, ids, s.ids);
    // at most 64, as many as max_tokens
    const big = try t.chat("{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1000}");
    try testing.expectEqual(@as(usize, 64), choice0(big).get("message").?.object.get("content").?.string.len);
    // raw completions too; health and models stay normal
    const raw = try t.post("/v1/completions", "{\"prompt\":\"17*19=\"}");
    try testing.expect(std.mem.indexOf(u8, raw.body, "\"text\":\"" ++ "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!" ++ "\"") != null);
    try testing.expectEqual(std.http.Status.ok, (try route(t.a(), .GET, "/health", "", &t.api)).status);
    try testing.expectEqual(std.http.Status.ok, (try route(t.a(), .GET, "/v1/models", "", &t.api)).status);
}

test "SIM_FAULT: unknown faults are refused" {
    try testing.expectEqual(Fault.none, try parseFault(null));
    try testing.expectEqual(Fault.none, try parseFault(""));
    try testing.expectEqual(Fault.garbage_token, try parseFault("garbage-token"));
    try testing.expectError(error.UnknownFault, parseFault("garbage"));
    try testing.expectError(error.UnknownFault, parseFault("GARBAGE-TOKEN"));
}
