//! What every personality shares: the context (io, allocators, environment, name), logging,
//! refusals, argument helpers, file checks, the tree digest and the temp-then-rename writes.
const std = @import("std");
const build_options = @import("build_options");

const Io = std.Io;
const Dir = Io.Dir;
const Allocator = std.mem.Allocator;

pub const version = build_options.version;
pub const commit = build_options.commit;

/// One running personality. `name` is what it logs as ("tensorfold-native", "vllm", ...).
pub const Ctx = struct {
    io: Io,
    /// Thread-safe, process lifetime.
    arena: Allocator,
    /// Thread-safe general purpose allocator.
    gpa: Allocator,
    env: *const std.process.Environ.Map,
    name: []const u8,

    /// One line on stderr, prefixed "<name> (simulator): ", written with one write so lines from
    /// several threads do not interleave.
    pub fn log(ctx: *const Ctx, comptime fmt: []const u8, args: anytype) void {
        var buf: [4096]u8 = undefined;
        var w: Io.Writer = .fixed(&buf);
        w.print("{s} (simulator): ", .{ctx.name}) catch {};
        w.print(fmt, args) catch {};
        rawLine(ctx.io, &buf, w.buffered().len);
    }

    /// A line exactly as given (no prefix): the CLI-parser messages real engines print.
    pub fn plain(ctx: *const Ctx, comptime fmt: []const u8, args: anytype) void {
        var buf: [4096]u8 = undefined;
        var w: Io.Writer = .fixed(&buf);
        w.print(fmt, args) catch {};
        rawLine(ctx.io, &buf, w.buffered().len);
    }

    /// Refuse to start: log the reason, exit 1.
    pub fn refuse(ctx: *const Ctx, comptime fmt: []const u8, args: anytype) noreturn {
        ctx.log(fmt, args);
        std.process.exit(1);
    }

    /// A command-line error: print the line as a CLI parser would, exit 2.
    pub fn usageError(ctx: *const Ctx, comptime fmt: []const u8, args: anytype) noreturn {
        ctx.plain(fmt, args);
        std.process.exit(2);
    }

    /// Print one line on stdout.
    pub fn out(ctx: *const Ctx, comptime fmt: []const u8, args: anytype) void {
        var buf: [4096]u8 = undefined;
        var w: Io.Writer = .fixed(&buf);
        w.print(fmt ++ "\n", args) catch {};
        Io.File.stdout().writeStreamingAll(ctx.io, w.buffered()) catch {};
    }

    /// A required environment variable, refused in the real engines' form "set NAME".
    pub fn requireEnv(ctx: *const Ctx, key: []const u8) []const u8 {
        const v = ctx.env.get(key) orelse ctx.refuse("set {s}", .{key});
        if (v.len == 0) ctx.refuse("set {s}", .{key});
        return v;
    }

    pub fn envInt(ctx: *const Ctx, comptime T: type, key: []const u8, value: []const u8) T {
        return std.fmt.parseInt(T, value, 10) catch ctx.refuse("{s}: not a number: '{s}'", .{ key, value });
    }
};

fn rawLine(io: Io, buf: *[4096]u8, len_in: usize) void {
    var len = len_in;
    if (len == buf.len) {
        buf[len - 1] = '\n';
    } else if (len == 0 or buf[len - 1] != '\n') {
        buf[len] = '\n';
        len += 1;
    }
    Io.File.stderr().writeStreamingAll(io, buf[0..len]) catch {};
}

// ------------------------------------------------------------------------------ arguments

/// Walks argv the way the real CLIs take it: "--flag value" or "--flag=value".
pub const Args = struct {
    items: []const []const u8,
    i: usize = 0,
    /// The value of the current "--flag=value", if it had one.
    inline_value: ?[]const u8 = null,

    pub fn init(items: []const []const u8) Args {
        return .{ .items = items };
    }

    /// The next token; a "--flag=value" token comes back as "--flag" with the value kept for `value`.
    pub fn next(a: *Args) ?[]const u8 {
        a.inline_value = null;
        if (a.i >= a.items.len) return null;
        const tok = a.items[a.i];
        a.i += 1;
        if (std.mem.startsWith(u8, tok, "--")) {
            if (std.mem.indexOfScalar(u8, tok, '=')) |eq| {
                a.inline_value = tok[eq + 1 ..];
                return tok[0..eq];
            }
        }
        return tok;
    }

    /// The value of the flag just taken; null when argv ran out.
    pub fn value(a: *Args) ?[]const u8 {
        if (a.inline_value) |v| {
            a.inline_value = null;
            return v;
        }
        if (a.i >= a.items.len) return null;
        const v = a.items[a.i];
        a.i += 1;
        return v;
    }
};

pub fn isFlag(tok: []const u8) bool {
    return tok.len > 1 and tok[0] == '-';
}

pub fn eql(a: []const u8, b: []const u8) bool {
    return std.mem.eql(u8, a, b);
}

pub fn oneOf(a: []const u8, comptime list: []const []const u8) bool {
    inline for (list) |x| if (std.mem.eql(u8, a, x)) return true;
    return false;
}

// ------------------------------------------------------------------------------ files

pub fn pathJoin(ctx: *const Ctx, a: []const u8, b: []const u8) []const u8 {
    return std.fs.path.join(ctx.arena, &.{ a, b }) catch ctx.refuse("out of memory", .{});
}

pub const Kind = enum { missing, file, directory, other };

/// What is at `path` (symlinks followed).
pub fn kindOf(io: Io, path: []const u8) Kind {
    const st = Dir.cwd().statFile(io, path, .{}) catch return .missing;
    return switch (st.kind) {
        .file => .file,
        .directory => .directory,
        else => .other,
    };
}

pub fn requireFile(ctx: *const Ctx, what: []const u8, path: []const u8) void {
    switch (kindOf(ctx.io, path)) {
        .file => {},
        .missing => ctx.refuse("{s}: {s} not found", .{ what, path }),
        else => ctx.refuse("{s}: {s} is not a file", .{ what, path }),
    }
}

pub fn requireDir(ctx: *const Ctx, what: []const u8, path: []const u8) void {
    switch (kindOf(ctx.io, path)) {
        .directory => {},
        .missing => ctx.refuse("{s}: {s} not found", .{ what, path }),
        else => ctx.refuse("{s}: {s} is not a folder", .{ what, path }),
    }
}

/// MODEL must be a folder holding config.json (what every engine opens first).
pub fn requireModel(ctx: *const Ctx, model: []const u8) void {
    requireDir(ctx, "model", model);
    requireFile(ctx, "model", pathJoin(ctx, model, "config.json"));
}

/// The names in a folder (no dot files), sorted; refuses when it cannot be read.
pub fn listDir(ctx: *const Ctx, what: []const u8, path: []const u8) []const []const u8 {
    var dir = Dir.cwd().openDir(ctx.io, path, .{ .iterate = true }) catch |e|
        ctx.refuse("{s}: cannot open {s}: {t}", .{ what, path, e });
    defer dir.close(ctx.io);
    var names: std.ArrayList([]const u8) = .empty;
    var it = dir.iterate();
    while (it.next(ctx.io) catch |e| ctx.refuse("{s}: cannot read {s}: {t}", .{ what, path, e })) |entry| {
        if (entry.name.len == 0 or entry.name[0] == '.') continue;
        names.append(ctx.arena, ctx.arena.dupe(u8, entry.name) catch oom(ctx)) catch oom(ctx);
    }
    const items = names.items;
    std.mem.sort([]const u8, items, {}, lessThanStr);
    return items;
}

fn lessThanStr(_: void, a: []const u8, b: []const u8) bool {
    return std.mem.lessThan(u8, a, b);
}

pub fn oom(ctx: *const Ctx) noreturn {
    ctx.refuse("out of memory", .{});
}

/// Write `data` to dir/name through a temp name in the same folder and a rename, so a reader never
/// sees half a file.
pub fn writeAtomic(ctx: *const Ctx, dir_path: []const u8, name: []const u8, data: []const u8) void {
    const io = ctx.io;
    Dir.cwd().createDirPath(io, dir_path) catch |e| ctx.refuse("cannot create {s}: {t}", .{ dir_path, e });
    var dir = Dir.cwd().openDir(io, dir_path, .{}) catch |e| ctx.refuse("cannot open {s}: {t}", .{ dir_path, e });
    defer dir.close(io);
    const tmp = std.fmt.allocPrint(ctx.arena, ".{s}.tmp-{d}", .{ name, std.os.linux.getpid() }) catch oom(ctx);
    dir.writeFile(io, .{ .sub_path = tmp, .data = data }) catch |e|
        ctx.refuse("cannot write {s}/{s}: {t}", .{ dir_path, tmp, e });
    dir.rename(tmp, dir, name, io) catch |e| {
        dir.deleteFile(io, tmp) catch {};
        ctx.refuse("cannot rename {s}/{s} to {s}: {t}", .{ dir_path, tmp, name, e });
    };
}

pub fn deleteIn(ctx: *const Ctx, dir_path: []const u8, name: []const u8) void {
    var dir = Dir.cwd().openDir(ctx.io, dir_path, .{}) catch return;
    defer dir.close(ctx.io);
    dir.deleteFile(ctx.io, name) catch |e| ctx.refuse("cannot remove {s}/{s}: {t}", .{ dir_path, name, e });
}

// ------------------------------------------------------------------------------ digests

const Sha256 = std.crypto.hash.sha2.Sha256;

pub const TreeDigest = struct {
    sha256: [32]u8,
    files: usize,
    bytes: u64,

    pub fn hex(d: TreeDigest) [64]u8 {
        return std.fmt.bytesToHex(d.sha256, .lower);
    }
};

/// A digest of a folder's files: every regular file under it (symlinks followed, dot files and
/// dot folders skipped), sorted by relative path, each fed as "path\0size\0bytes". The same files
/// give the same digest wherever the folder is.
pub fn digestTree(ctx: *const Ctx, what: []const u8, root: []const u8) TreeDigest {
    var rels: std.ArrayList([]const u8) = .empty;
    collect(ctx, what, root, "", 0, &rels);
    std.mem.sort([]const u8, rels.items, {}, lessThanStr);
    var h = Sha256.init(.{});
    var files: usize = 0;
    var bytes: u64 = 0;
    var buf: [64 * 1024]u8 = undefined;
    for (rels.items) |rel| {
        const full = pathJoin(ctx, root, rel);
        const f = Dir.cwd().openFile(ctx.io, full, .{}) catch |e| ctx.refuse("{s}: cannot open {s}: {t}", .{ what, full, e });
        defer f.close(ctx.io);
        const size = f.length(ctx.io) catch |e| ctx.refuse("{s}: cannot stat {s}: {t}", .{ what, full, e });
        var size_buf: [24]u8 = undefined;
        h.update(rel);
        h.update("\x00");
        h.update(std.fmt.bufPrint(&size_buf, "{d}", .{size}) catch unreachable);
        h.update("\x00");
        var got: u64 = 0;
        while (true) {
            var vec = [_][]u8{&buf};
            const n = f.readStreaming(ctx.io, &vec) catch |e| switch (e) {
                error.EndOfStream => break,
                else => ctx.refuse("{s}: cannot read {s}: {t}", .{ what, full, e }),
            };
            if (n == 0) break;
            h.update(buf[0..n]);
            got += n;
        }
        if (got != size) ctx.refuse("{s}: {s} changed while it was read", .{ what, full });
        files += 1;
        bytes += size;
    }
    return .{ .sha256 = h.finalResult(), .files = files, .bytes = bytes };
}

fn collect(ctx: *const Ctx, what: []const u8, root: []const u8, rel: []const u8, depth: u32, out: *std.ArrayList([]const u8)) void {
    if (depth > 16) ctx.refuse("{s}: {s}/{s}: folders nested too deep (a symlink loop?)", .{ what, root, rel });
    const here = if (rel.len == 0) root else pathJoin(ctx, root, rel);
    for (listDir(ctx, what, here)) |name| {
        const sub = if (rel.len == 0) name else std.fmt.allocPrint(ctx.arena, "{s}/{s}", .{ rel, name }) catch oom(ctx);
        switch (kindOf(ctx.io, pathJoin(ctx, root, sub))) {
            .file => out.append(ctx.arena, sub) catch oom(ctx),
            .directory => collect(ctx, what, root, sub, depth + 1, out),
            else => {},
        }
    }
}

/// `len` bytes that stand in for real weights: SHA-256 of (seed, counter) repeated. Deterministic.
pub fn payload(ctx: *const Ctx, seed: []const u8, len: usize) []u8 {
    const bytes = ctx.arena.alloc(u8, len) catch oom(ctx);
    var counter: u64 = 0;
    var off: usize = 0;
    while (off < len) : (counter += 1) {
        var h = Sha256.init(.{});
        h.update(seed);
        var cbuf: [8]u8 = undefined;
        std.mem.writeInt(u64, &cbuf, counter, .little);
        h.update(&cbuf);
        const block = h.finalResult();
        const n = @min(block.len, len - off);
        @memcpy(bytes[off..][0..n], block[0..n]);
        off += n;
    }
    return bytes;
}

pub fn sha256Hex(data: []const u8) [64]u8 {
    var out: [32]u8 = undefined;
    Sha256.hash(data, &out, .{});
    return std.fmt.bytesToHex(out, .lower);
}

// ------------------------------------------------------------------------------ sim file headers

/// The simulated weight files (rank caches, Engram packs) are a small text header, a blank line and
/// a payload: "TFSIM-<KIND> 1\nkey value\n...\n\n<payload>". `payload-sha256` covers the payload.
pub const Header = struct {
    kind: []const u8,
    fields: [8]struct { key: []const u8, value: []const u8 } = undefined,
    n: usize = 0,
    body: []const u8 = "",

    pub fn get(h: *const Header, key: []const u8) ?[]const u8 {
        for (h.fields[0..h.n]) |f| if (eql(f.key, key)) return f.value;
        return null;
    }
};

pub fn parseHeader(data: []const u8) ?Header {
    const end = std.mem.indexOf(u8, data, "\n\n") orelse return null;
    var lines = std.mem.splitScalar(u8, data[0..end], '\n');
    const first = lines.next() orelse return null;
    if (!std.mem.startsWith(u8, first, "TFSIM-") or !std.mem.endsWith(u8, first, " 1")) return null;
    var h: Header = .{ .kind = first[6 .. first.len - 2] };
    while (lines.next()) |line| {
        const sp = std.mem.indexOfScalar(u8, line, ' ') orelse return null;
        if (h.n == h.fields.len) return null;
        h.fields[h.n] = .{ .key = line[0..sp], .value = line[sp + 1 ..] };
        h.n += 1;
    }
    h.body = data[end + 2 ..];
    const want = h.get("payload-sha256") orelse return null;
    if (!eql(&sha256Hex(h.body), want)) return null;
    return h;
}

// ------------------------------------------------------------------------------ per-rank file names

/// "rank<G>of<W>-<hex>.bin" -> (G, W); null if the name is not a rank cache file.
pub fn parseRankCacheName(name: []const u8) ?struct { rank: u32, world: u32 } {
    if (!std.mem.startsWith(u8, name, "rank") or !std.mem.endsWith(u8, name, ".bin")) return null;
    const mid = name[4 .. name.len - 4];
    const of = std.mem.indexOf(u8, mid, "of") orelse return null;
    const dash = std.mem.indexOfScalar(u8, mid, '-') orelse return null;
    if (dash < of) return null;
    const rank = std.fmt.parseInt(u32, mid[0..of], 10) catch return null;
    const world = std.fmt.parseInt(u32, mid[of + 2 .. dash], 10) catch return null;
    if (dash + 1 >= mid.len) return null;
    return .{ .rank = rank, .world = world };
}

/// "engram-l<L>-r<R>of<W>.bin" -> (L, R, W); null otherwise.
pub fn parseEngramName(name: []const u8) ?struct { layer: u32, rank: u32, world: u32 } {
    if (!std.mem.startsWith(u8, name, "engram-l") or !std.mem.endsWith(u8, name, ".bin")) return null;
    const mid = name[8 .. name.len - 4];
    const dash = std.mem.indexOf(u8, mid, "-r") orelse return null;
    const of = std.mem.indexOf(u8, mid, "of") orelse return null;
    if (of < dash) return null;
    const layer = std.fmt.parseInt(u32, mid[0..dash], 10) catch return null;
    const rank = std.fmt.parseInt(u32, mid[dash + 2 .. of], 10) catch return null;
    const world = std.fmt.parseInt(u32, mid[of + 2 ..], 10) catch return null;
    return .{ .layer = layer, .rank = rank, .world = world };
}

/// The rank cache check of tensorfold-native and tf-dsv41-lanes: the folder holds exactly one
/// rank<rank>of<world>-*.bin (a valid simulated rank cache for that rank and world) and no file of
/// another rank. Returns the file's name.
pub fn checkRankCache(ctx: *const Ctx, dir: []const u8, rank: u32, world: u32) []const u8 {
    requireDir(ctx, "rank cache", dir);
    var mine: ?[]const u8 = null;
    for (listDir(ctx, "rank cache", dir)) |name| {
        const p = parseRankCacheName(name) orelse continue;
        if (p.rank != rank)
            ctx.refuse("rank cache: {s} is rank {d}'s, this is rank {d}", .{ name, p.rank, rank });
        if (p.world != world)
            ctx.refuse("rank cache: {s} is for a world of {d}, this is a world of {d}", .{ name, p.world, world });
        if (mine) |first|
            ctx.refuse("rank cache: two files for rank {d} of {d} in {s}: {s} and {s}", .{ rank, world, dir, first, name });
        mine = name;
    }
    const name = mine orelse
        ctx.refuse("rank cache: no rank{d}of{d}-*.bin in {s} (run tf-dsv41-rank-cache)", .{ rank, world, dir });
    const full = pathJoin(ctx, dir, name);
    const data = Dir.cwd().readFileAlloc(ctx.io, full, ctx.arena, .limited(64 << 20)) catch |e|
        ctx.refuse("rank cache: cannot read {s}: {t}", .{ full, e });
    const h = parseHeader(data) orelse ctx.refuse("rank cache: {s} is not a rank cache file (or is damaged)", .{full});
    var want_rank: [12]u8 = undefined;
    var want_world: [12]u8 = undefined;
    if (!eql(h.kind, "RANKCACHE") or
        !eql(h.get("rank") orelse "", std.fmt.bufPrint(&want_rank, "{d}", .{rank}) catch unreachable) or
        !eql(h.get("world") orelse "", std.fmt.bufPrint(&want_world, "{d}", .{world}) catch unreachable))
        ctx.refuse("rank cache: {s}: its header is not rank {d} of {d}", .{ full, rank, world });
    return name;
}

test "rank cache names" {
    const p = parseRankCacheName("rank1of4-0123456789abcdef0123.bin").?;
    try std.testing.expectEqual(@as(u32, 1), p.rank);
    try std.testing.expectEqual(@as(u32, 4), p.world);
    try std.testing.expect(parseRankCacheName("rank1of4.bin") == null);
    try std.testing.expect(parseRankCacheName("dsv41_token_map.json") == null);
    const e = parseEngramName("engram-l14-r0of2.bin").?;
    try std.testing.expectEqual(@as(u32, 14), e.layer);
    try std.testing.expectEqual(@as(u32, 0), e.rank);
    try std.testing.expectEqual(@as(u32, 2), e.world);
    try std.testing.expect(parseEngramName("engram-x.bin") == null);
}

test "args" {
    var a = Args.init(&.{ "--port=8000", "--host", "h", "x" });
    try std.testing.expectEqualStrings("--port", a.next().?);
    try std.testing.expectEqualStrings("8000", a.value().?);
    try std.testing.expectEqualStrings("--host", a.next().?);
    try std.testing.expectEqualStrings("h", a.value().?);
    try std.testing.expectEqualStrings("x", a.next().?);
    try std.testing.expect(a.next() == null);
}
