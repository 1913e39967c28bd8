//! The simulator's stand-in for a model: what a completion answers, as a pure function of its input.
//! No weights, no sampling: the same prompt gives the same text and the same token ids, whatever else
//! runs at the same time (every function here takes its memory from the caller's arena and touches
//! no shared state).
//!
//! - Tokens: a token is a run of whitespace followed by a run of non-whitespace ("1", " 2", " 3"), so
//!   the tokens of a text concatenate to the text. A token's id is FNV-1a 64 of its bytes mod 100000.
//! - Answers: a fixed table of known prompts ("17*19=" -> "323", ...), else a sentence of distinct
//!   words drawn from a hash of the prompt.
//! - Tool calls: the first (or the named) tool, its required parameters filled from the prompt.
//! - Tool results: a sentence that repeats the tool result's values verbatim.
const std = @import("std");

const Allocator = std.mem.Allocator;

/// Token ids are below this.
pub const vocab_size: u64 = 100000;

/// The token the garbage-token fault repeats.
pub const garbage_token = "!";

/// FNV-1a, 64 bits: stable across Zig releases (it is written out here, not taken from std).
pub fn fnv1a64(data: []const u8) u64 {
    var h: u64 = 0xcbf29ce484222325;
    for (data) |c| {
        h ^= c;
        h *%= 0x100000001b3;
    }
    return h;
}

pub fn tokenId(text: []const u8) u32 {
    return @intCast(fnv1a64(text) % vocab_size);
}

pub const Token = struct { text: []const u8, id: u32 };

fn isSpace(c: u8) bool {
    return c == ' ' or c == '\t' or c == '\n' or c == '\r';
}

/// Split `text` into tokens (whitespace run + non-whitespace run); the slices point into `text`.
pub fn tokenize(arena: Allocator, text: []const u8) ![]Token {
    var out: std.ArrayList(Token) = .empty;
    var start: usize = 0;
    var i: usize = 1;
    while (i < text.len) : (i += 1) {
        if (isSpace(text[i]) and !isSpace(text[i - 1])) {
            try out.append(arena, .{ .text = text[start..i], .id = tokenId(text[start..i]) });
            start = i;
        }
    }
    if (start < text.len) try out.append(arena, .{ .text = text[start..], .id = tokenId(text[start..]) });
    return out.items;
}

pub fn ids(arena: Allocator, tokens: []const Token) ![]u32 {
    const out = try arena.alloc(u32, tokens.len);
    for (tokens, out) |t, *o| o.* = t.id;
    return out;
}

/// `n` copies of the garbage token.
pub fn garbage(arena: Allocator, n: usize) ![]Token {
    const out = try arena.alloc(Token, n);
    for (out) |*t| t.* = .{ .text = garbage_token, .id = tokenId(garbage_token) };
    return out;
}

/// The tokens' texts, joined.
pub fn join(arena: Allocator, tokens: []const Token) ![]const u8 {
    var out: std.ArrayList(u8) = .empty;
    for (tokens) |t| try out.appendSlice(arena, t.text);
    return out.items;
}

// ------------------------------------------------------------------------------ answers

const Known = struct { prompt: []const u8, answer: []const u8 };

/// The prompts with a fixed answer (compared after trimming surrounding whitespace).
pub const known = [_]Known{
    .{ .prompt = "17*19=", .answer = "323" },
    .{ .prompt = "17*23=", .answer = "391" },
    .{ .prompt = "Say OK.", .answer = "OK" },
    .{ .prompt = "What is the capital of France?", .answer = "Paris" },
    .{ .prompt = "Name a colour.", .answer = "blue" },
};

/// What the model answers to `prompt` (the last user message, or a raw completion's prompt).
pub fn answer(arena: Allocator, prompt: []const u8) ![]const u8 {
    const p = std.mem.trim(u8, prompt, " \t\r\n");
    for (known) |k| if (std.mem.eql(u8, p, k.prompt)) return k.answer;
    if (std.mem.eql(u8, p, "Count from one to twenty.")) return count(arena, 20);
    if (std.mem.eql(u8, p, "Count from 1 to 100, separated by spaces.")) return count(arena, 100);
    return sentence(arena, p);
}

/// "1 2 3 ... n"
fn count(arena: Allocator, n: u32) ![]const u8 {
    var out: std.ArrayList(u8) = .empty;
    var i: u32 = 1;
    while (i <= n) : (i += 1) {
        if (i > 1) try out.append(arena, ' ');
        try out.print(arena, "{d}", .{i});
    }
    return out.items;
}

/// SplitMix64: a small, fully specified generator (stable across Zig releases).
const Mix = struct {
    state: u64,

    fn next(m: *Mix) u64 {
        m.state +%= 0x9e3779b97f4a7c15;
        var z = m.state;
        z = (z ^ (z >> 30)) *% 0xbf58476d1ce4e5b9;
        z = (z ^ (z >> 27)) *% 0x94d049bb133111eb;
        return z ^ (z >> 31);
    }

    /// An index into `list` not yet in `used` (marked used).
    fn pick(m: *Mix, comptime list: []const []const u8, used: *[list.len]bool) []const u8 {
        while (true) {
            const i: usize = @intCast(m.next() % list.len);
            if (used[i]) continue;
            used[i] = true;
            return list[i];
        }
    }
};

const adjectives = [_][]const u8{
    "quiet",  "bright", "distant", "gentle", "silver",  "ancient", "curious",  "patient",
    "golden", "hidden", "narrow",  "steady", "hollow",  "vivid",   "humble",   "crimson",
    "tender", "rapid",  "sleepy",  "clever", "frozen",  "wooden",  "restless", "lucky",
    "amber",  "brave",  "calm",    "eager",  "fragile", "hungry",  "lonely",   "mellow",
};
const nouns = [_][]const u8{
    "rivers",   "lanterns",  "harbors", "meadows", "engines", "sparrows", "bridges", "gardens",
    "letters",  "mountains", "candles", "ships",   "clocks",  "forests",  "windows", "villages",
    "orchards", "maps",      "bells",   "islands", "mirrors", "tunnels",  "kettles", "ladders",
    "comets",   "pebbles",   "violins", "towers",  "streets", "rooftops", "valleys", "compasses",
};
const verbs = [_][]const u8{
    "carry",  "follow", "guard",   "paint",  "gather",  "remember", "watch", "shelter",
    "answer", "trace",  "welcome", "polish", "measure", "borrow",   "echo",  "light",
};
const preps = [_][]const u8{ "toward", "beside", "beyond", "across", "beneath", "around", "near", "behind" };

/// One or two sentences of distinct words, from a hash of the prompt:
/// "Quiet rivers carry golden lanterns toward distant harbors."
pub fn sentence(arena: Allocator, prompt: []const u8) ![]const u8 {
    var m: Mix = .{ .state = fnv1a64(prompt) };
    var ua: [adjectives.len]bool = @splat(false);
    var un: [nouns.len]bool = @splat(false);
    var uv: [verbs.len]bool = @splat(false);
    var up: [preps.len]bool = @splat(false);
    var out: std.ArrayList(u8) = .empty;
    const sentences: u64 = 1 + m.next() % 2;
    var s: u64 = 0;
    while (s < sentences) : (s += 1) {
        if (s > 0) try out.append(arena, ' ');
        const first = out.items.len;
        try out.print(arena, "{s} {s} {s} {s} {s} {s} {s} {s}.", .{
            m.pick(&adjectives, &ua), m.pick(&nouns, &un), m.pick(&verbs, &uv),      m.pick(&adjectives, &ua),
            m.pick(&nouns, &un),      m.pick(&preps, &up), m.pick(&adjectives, &ua), m.pick(&nouns, &un),
        });
        out.items[first] = std.ascii.toUpper(out.items[first]);
    }
    return out.items;
}

/// The reasoning a thinking turn shows before its answer.
pub fn reasoning(arena: Allocator, prompt: []const u8, then: []const u8) ![]const u8 {
    const p = std.mem.trim(u8, prompt, " \t\r\n");
    const stop = p.len > 0 and (p[p.len - 1] == '.' or p[p.len - 1] == '?' or p[p.len - 1] == '!');
    return std.fmt.allocPrint(arena, "The user asks: {s}{s} {s}", .{ p, if (stop) "" else ".", then });
}

// ------------------------------------------------------------------------------ tool calls

/// The words of the prompt that name what it asks about: the last run of capitalised words (not
/// counting the prompt's first word, which is capitalised anyway), stripped of punctuation; else the
/// prompt's last word. "What is the weather in Paris?" -> "Paris"; "... in New York?" -> "New York".
pub fn subject(arena: Allocator, prompt: []const u8) ![]const u8 {
    var run: std.ArrayList([]const u8) = .empty; // the current run of capitalised words
    var last_run: []const []const u8 = &.{};
    var first_word: []const u8 = "";
    var last_word: []const u8 = "";
    var broken = true; // the previous word ended with punctuation (or there was none)
    var n: usize = 0;
    var it = std.mem.tokenizeAny(u8, prompt, " \t\r\n");
    while (it.next()) |word| : (n += 1) {
        const core = std.mem.trim(u8, word, "\"'`.,;:!?()[]{}<>*");
        const cut_after = core.len == 0 or core.ptr + core.len != word.ptr + word.len;
        if (core.len > 0) last_word = core;
        if (n == 0) first_word = core;
        const capital = core.len > 0 and std.ascii.isUpper(core[0]);
        if (capital and n > 0) {
            if (broken) run = .empty;
            try run.append(arena, core);
            last_run = run.items;
        } else {
            run = .empty;
        }
        broken = cut_after or !capital or n == 0;
    }
    if (last_run.len > 0) return std.mem.join(arena, " ", last_run);
    if (first_word.len > 0 and n == 1) return first_word;
    return last_word;
}

/// The first integer in the prompt, or 0.
fn firstNumber(prompt: []const u8) i64 {
    var i: usize = 0;
    while (i < prompt.len) : (i += 1) {
        if (std.ascii.isDigit(prompt[i])) {
            var j = i;
            while (j < prompt.len and std.ascii.isDigit(prompt[j])) j += 1;
            return std.fmt.parseInt(i64, prompt[i..j], 10) catch 0;
        }
    }
    return 0;
}

pub const ToolCall = struct {
    id: []const u8,
    name: []const u8,
    /// JSON text of an object, as Python's json.dumps writes it: {"city": "Paris"}
    arguments: []const u8,
    /// What the model "generated" for the call (its tokens): {"name": ..., "arguments": ...}
    generated: []const u8,
};

/// The call the model makes to `tool` (an OpenAI tool object's "function") for `prompt`: every
/// required parameter, a string from the prompt (see `subject`), an integer or number from its first
/// number, a boolean false, an empty list or object.
pub fn toolCall(arena: Allocator, prompt: []const u8, name: []const u8, parameters: ?std.json.Value) !ToolCall {
    const subj = try subject(arena, prompt);
    var args: std.Io.Writer.Allocating = .init(arena);
    const w = &args.writer;
    try w.writeByte('{');
    var n: usize = 0;
    if (parameters) |params| if (params == .object) {
        const required = params.object.get("required");
        const props = params.object.get("properties");
        if (required != null and required.? == .array) for (required.?.array.items) |r| {
            if (r != .string) continue;
            var typ: []const u8 = "string";
            if (props != null and props.? == .object) if (props.?.object.get(r.string)) |p| if (p == .object) {
                if (p.object.get("type")) |t| if (t == .string) {
                    typ = t.string;
                };
            };
            if (n > 0) try w.writeAll(", ");
            n += 1;
            try std.json.Stringify.encodeJsonString(r.string, .{}, w);
            try w.writeAll(": ");
            if (std.mem.eql(u8, typ, "integer") or std.mem.eql(u8, typ, "number")) {
                try w.print("{d}", .{firstNumber(prompt)});
            } else if (std.mem.eql(u8, typ, "boolean")) {
                try w.writeAll("false");
            } else if (std.mem.eql(u8, typ, "array")) {
                try w.writeAll("[]");
            } else if (std.mem.eql(u8, typ, "object")) {
                try w.writeAll("{}");
            } else {
                try std.json.Stringify.encodeJsonString(subj, .{}, w);
            }
        };
    };
    try w.writeByte('}');
    const arguments = args.written();
    var gen: std.Io.Writer.Allocating = .init(arena);
    try gen.writer.writeAll("{\"name\": ");
    try std.json.Stringify.encodeJsonString(name, .{}, &gen.writer);
    try gen.writer.print(", \"arguments\": {s}}}", .{arguments});
    var h: u64 = fnv1a64(prompt);
    h ^= fnv1a64(gen.written());
    return .{
        .id = try std.fmt.allocPrint(arena, "call_{x:0>16}", .{h}),
        .name = name,
        .arguments = arguments,
        .generated = gen.written(),
    };
}

/// A value as the reply repeats it: a string as it is, anything else as its JSON text (numbers as
/// they were written: parse with .parse_numbers = false).
fn valueText(arena: Allocator, v: std.json.Value) ![]const u8 {
    return switch (v) {
        .string => |s| s,
        .number_string => |s| s,
        else => std.json.Stringify.valueAlloc(arena, v, .{}),
    };
}

/// "get_weather" -> "weather"; "lookup_stock_price" -> "stock price"; "" -> "result".
fn topic(arena: Allocator, name: []const u8) ![]const u8 {
    var t = name;
    inline for (.{ "get_", "fetch_", "lookup_", "search_", "find_", "query_" }) |p| {
        if (std.mem.startsWith(u8, t, p) and t.len > p.len) t = t[p.len..];
    }
    if (t.len == 0) return "result";
    const out = try arena.dupe(u8, t);
    for (out) |*c| if (c.* == '_' or c.* == '-') {
        c.* = ' ';
    };
    return out;
}

/// The sentence a turn after a tool result answers: "The weather in Paris is sunny, 21, C." from a
/// call of get_weather({"city": "Paris"}) and the result {"condition": "sunny", "temp": 21, "unit": "C"}.
/// `name` and `arguments` are the call's (empty when the call is not known), `result` the tool
/// message's content. Every value of a JSON object result appears verbatim (one that only repeats an
/// argument is said once, as the subject).
pub fn toolResultSentence(arena: Allocator, name: []const u8, arguments: []const u8, result: []const u8) ![]const u8 {
    const opts: std.json.ParseOptions = .{ .parse_numbers = false, .duplicate_field_behavior = .use_last };
    var subj: std.ArrayList(u8) = .empty;
    var arg_texts: std.ArrayList([]const u8) = .empty;
    if (std.json.parseFromSliceLeaky(std.json.Value, arena, arguments, opts)) |args| {
        if (args == .object) for (args.object.values()) |v| {
            if (subj.items.len > 0) try subj.appendSlice(arena, ", ");
            const text = try valueText(arena, v);
            try subj.appendSlice(arena, text);
            try arg_texts.append(arena, text);
        };
    } else |_| {}
    var vals: std.ArrayList(u8) = .empty;
    const trimmed = std.mem.trim(u8, result, " \t\r\n");
    if (std.json.parseFromSliceLeaky(std.json.Value, arena, trimmed, opts)) |res| {
        if (res == .object) {
            // every value, but those that only repeat the call's arguments (the subject says them)
            var texts: std.ArrayList([]const u8) = .empty;
            for (res.object.values()) |v| {
                const text = try valueText(arena, v);
                for (arg_texts.items) |a| {
                    if (std.mem.eql(u8, a, text)) break;
                } else try texts.append(arena, text);
            }
            if (texts.items.len == 0) for (res.object.values()) |v| try texts.append(arena, try valueText(arena, v));
            for (texts.items) |text| {
                if (vals.items.len > 0) try vals.appendSlice(arena, ", ");
                try vals.appendSlice(arena, text);
            }
        } else {
            try vals.appendSlice(arena, try valueText(arena, res));
        }
    } else |_| {
        try vals.appendSlice(arena, trimmed);
    }
    if (vals.items.len == 0) try vals.appendSlice(arena, "empty");
    const t = try topic(arena, name);
    if (subj.items.len > 0) return std.fmt.allocPrint(arena, "The {s} for {s} is {s}.", .{ t, subj.items, vals.items });
    return std.fmt.allocPrint(arena, "The {s} is {s}.", .{ t, vals.items });
}

// ------------------------------------------------------------------------------ tests

const testing = std.testing;

test "tokens concatenate to the text; ids are stable" {
    var a: std.heap.ArenaAllocator = .init(testing.allocator);
    defer a.deinit();
    const toks = try tokenize(a.allocator(), "1 2  3\nfour ");
    try testing.expectEqual(@as(usize, 5), toks.len);
    try testing.expectEqualStrings(" 2", toks[1].text);
    try testing.expectEqualStrings("  3", toks[2].text);
    try testing.expectEqualStrings("\nfour", toks[3].text);
    try testing.expectEqualStrings(" ", toks[4].text);
    try testing.expectEqualStrings("1 2  3\nfour ", try join(a.allocator(), toks));
    try testing.expectEqual(tokenId(" 2"), toks[1].id);
    // FNV-1a 64 of "323" mod 100000, fixed forever
    try testing.expectEqual(@as(u64, 0xcbf29ce484222325), fnv1a64(""));
    try testing.expect(tokenId("323") < vocab_size);
    try testing.expectEqual(@as(usize, 0), (try tokenize(a.allocator(), "")).len);
}

test "known answers, counting, and sentences of distinct words" {
    var a: std.heap.ArenaAllocator = .init(testing.allocator);
    defer a.deinit();
    const al = a.allocator();
    try testing.expectEqualStrings("323", try answer(al, "17*19="));
    try testing.expectEqualStrings("391", try answer(al, " 17*23=\n"));
    try testing.expectEqualStrings("Paris", try answer(al, "What is the capital of France?"));
    const twenty = try answer(al, "Count from one to twenty.");
    try testing.expect(std.mem.startsWith(u8, twenty, "1 2 3 4 "));
    try testing.expect(std.mem.endsWith(u8, twenty, " 19 20"));
    try testing.expectEqual(@as(usize, 20), (try tokenize(al, twenty)).len);
    const hundred = try answer(al, "Count from 1 to 100, separated by spaces.");
    try testing.expectEqual(@as(usize, 100), (try tokenize(al, hundred)).len);
    for ([_][]const u8{ "hello", "Tell me a story.", "", "hi" }) |p| {
        const s = try answer(al, p);
        try testing.expectEqualStrings(s, try answer(al, p));
        try testing.expect(std.ascii.isUpper(s[0]) and s[s.len - 1] == '.');
        const words = try tokenize(al, s);
        try testing.expect(words.len >= 8);
        for (words, 0..) |w, i| for (words[i + 1 ..]) |x| {
            try testing.expect(!std.mem.eql(u8, std.mem.trim(u8, w.text, " ."), std.mem.trim(u8, x.text, " .")));
        };
    }
    try testing.expect(!std.mem.eql(u8, try answer(al, "hello"), try answer(al, "hello!")));
}

test "the subject of a prompt" {
    var a: std.heap.ArenaAllocator = .init(testing.allocator);
    defer a.deinit();
    const al = a.allocator();
    try testing.expectEqualStrings("Paris", try subject(al, "What is the weather in Paris?"));
    try testing.expectEqualStrings("New York", try subject(al, "What's the weather like in New York today?"));
    try testing.expectEqualStrings("Paris", try subject(al, "In Paris, is it raining?"));
    try testing.expectEqualStrings("France", try subject(al, "Weather in Paris, France?"));
    try testing.expectEqualStrings("paris", try subject(al, "weather in paris"));
    try testing.expectEqualStrings("Paris", try subject(al, "Paris"));
}

test "tool calls and tool results" {
    var a: std.heap.ArenaAllocator = .init(testing.allocator);
    defer a.deinit();
    const al = a.allocator();
    const params = try std.json.parseFromSliceLeaky(std.json.Value, al,
        \\{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city","days"]}
    , .{});
    const c = try toolCall(al, "What is the weather in Paris in 3 days?", "get_weather", params);
    try testing.expectEqualStrings("{\"city\": \"Paris\", \"days\": 3}", c.arguments);
    try testing.expect(std.mem.startsWith(u8, c.id, "call_") and c.id.len == 5 + 16);
    try testing.expectEqualStrings("{}", (try toolCall(al, "hi", "ping", null)).arguments);
    const s = try toolResultSentence(al, "get_weather", "{\"city\": \"Paris\"}", "{\"condition\": \"sunny\", \"temperature\": 21.50, \"unit\": \"C\"}");
    try testing.expectEqualStrings("The weather for Paris is sunny, 21.50, C.", s);
    try testing.expectEqualStrings("The result is not json.", try toolResultSentence(al, "", "", "not json"));
    // a value that repeats an argument is said once, as the subject
    const g = try toolResultSentence(al, "get_weather", "{\"city\": \"Paris\"}", "{\"city\": \"Paris\", \"weather\": \"sunny\", \"celsius\": 21}");
    try testing.expectEqualStrings("The weather for Paris is sunny, 21.", g);
    try testing.expectEqualStrings("The weather for Paris is Paris.", try toolResultSentence(al, "get_weather", "{\"city\": \"Paris\"}", "{\"city\": \"Paris\"}"));
}
