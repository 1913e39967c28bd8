//! The rendezvous every multi-rank engine does, reduced to its direction and its checks.
//!
//! The head (rank 0) listens on the rendezvous port on all addresses; each follower dials it and
//! sends one line, "JOIN <family> <rank> <world>\n". The head answers "OK ..." or "REFUSED <why>"
//! (and logs the refusal). A joined follower keeps the connection open: when the head goes away the
//! follower exits 1, and when a joined follower goes away the head exits 1 (a tensor-parallel group
//! does not survive losing a rank). A connection that closes before a JOIN line (a readiness probe
//! of the port) is ignored.
const std = @import("std");
const common = @import("common.zig");

const Io = std.Io;
const Ctx = common.Ctx;

/// The wire family: followers of one engine cannot join another engine's head.
pub const Family = enum {
    tensorfold_native,
    tensorfold_python,
    vllm,

    pub fn word(f: Family) []const u8 {
        return switch (f) {
            .tensorfold_native => "tensorfold-native",
            .tensorfold_python => "tensorfold-python",
            .vllm => "vllm",
        };
    }
};

pub const max_world = 64;

/// The head's view of the group: which follower ranks have joined.
pub const Registry = struct {
    ctx: *const Ctx,
    family: Family,
    world: u32,
    port: u16,
    /// Bit r set: rank r (>= 1) is joined.
    mask: std.atomic.Value(u64) = .init(0),
    server: Io.net.Server = undefined,
    accept_group: Io.Group = .init,
    conn_group: Io.Group = .init,

    /// Ranks up, the head included.
    pub fn joined(r: *const Registry) u32 {
        return @popCount(r.mask.load(.acquire)) + 1;
    }

    pub fn ready(r: *const Registry) bool {
        return r.joined() >= r.world;
    }
};

/// Listen on 0.0.0.0:port (refusing if the port cannot be bound) and accept followers from a task
/// of its own. The registry lives for the rest of the process.
pub fn startHead(ctx: *const Ctx, family: Family, world: u32, port: u16) *Registry {
    if (world == 0 or world > max_world) ctx.refuse("world size {d}: the simulator takes 1 to {d}", .{ world, max_world });
    const reg = ctx.arena.create(Registry) catch common.oom(ctx);
    reg.* = .{ .ctx = ctx, .family = family, .world = world, .port = port };
    const addr: Io.net.IpAddress = .{ .ip4 = .unspecified(port) };
    reg.server = addr.listen(ctx.io, .{ .reuse_address = true }) catch |e|
        ctx.refuse("rendezvous: cannot listen on 0.0.0.0:{d}: {t}", .{ port, e });
    reg.accept_group.concurrent(ctx.io, acceptLoop, .{reg}) catch |e|
        ctx.refuse("rendezvous: cannot start the accept task: {t}", .{e});
    return reg;
}

fn acceptLoop(reg: *Registry) Io.Cancelable!void {
    const ctx = reg.ctx;
    while (true) {
        const stream = reg.server.accept(ctx.io) catch |e| switch (e) {
            error.Canceled => return error.Canceled,
            else => {
                ctx.log("rendezvous: accept: {t}", .{e});
                try ctx.io.sleep(.fromMilliseconds(100), .awake);
                continue;
            },
        };
        reg.conn_group.concurrent(ctx.io, handleFollower, .{ reg, stream }) catch {
            ctx.log("rendezvous: no thread for a follower connection; closing it", .{});
            stream.close(ctx.io);
        };
    }
}

fn handleFollower(reg: *Registry, stream: Io.net.Stream) Io.Cancelable!void {
    const ctx = reg.ctx;
    const io = ctx.io;
    defer stream.close(io);
    var peer_buf: [64]u8 = undefined;
    const peer = std.fmt.bufPrint(&peer_buf, "{f}", .{stream.socket.address}) catch "?";
    var recv_buf: [512]u8 = undefined;
    var send_buf: [512]u8 = undefined;
    var sr = stream.reader(io, &recv_buf);
    var sw = stream.writer(io, &send_buf);
    const r = &sr.interface;
    const w = &sw.interface;

    const line = (r.takeDelimiter('\n') catch return) orelse return; // closed before a JOIN: a probe
    var it = std.mem.tokenizeScalar(u8, std.mem.trimEnd(u8, line, "\r"), ' ');
    const verb = it.next() orelse "";
    const fam = it.next() orelse "";
    const rank_s = it.next() orelse "";
    const world_s = it.next() orelse "";
    if (!common.eql(verb, "JOIN") or it.next() != null) {
        refuseJoin(reg, w, peer, "not a JOIN line", .{});
        return;
    }
    if (!common.eql(fam, reg.family.word())) {
        refuseJoin(reg, w, peer, "a {s} rank cannot join a {s} head", .{ fam, reg.family.word() });
        return;
    }
    const rank = std.fmt.parseInt(u32, rank_s, 10) catch {
        refuseJoin(reg, w, peer, "rank '{s}' is not a number", .{rank_s});
        return;
    };
    const world = std.fmt.parseInt(u32, world_s, 10) catch {
        refuseJoin(reg, w, peer, "world '{s}' is not a number", .{world_s});
        return;
    };
    if (world != reg.world) {
        refuseJoin(reg, w, peer, "rank {d} has a world of {d}, this head's is {d}", .{ rank, world, reg.world });
        return;
    }
    if (rank == 0 or rank >= reg.world) {
        refuseJoin(reg, w, peer, "rank {d} is not a follower rank of a world of {d} (1..{d})", .{ rank, reg.world, reg.world - 1 });
        return;
    }
    const bit = @as(u64, 1) << @intCast(rank);
    const before = reg.mask.fetchOr(bit, .acq_rel);
    if (before & bit != 0) {
        refuseJoin(reg, w, peer, "rank {d} has already joined", .{rank});
        return;
    }
    const now = reg.joined();
    w.print("OK rank {d} of {d} joined\n", .{ rank, reg.world }) catch {};
    w.flush() catch {};
    ctx.log("rank {d} of {d} joined from {s} ({d} of {d} ranks up)", .{ rank, reg.world, peer, now, reg.world });
    if (now == reg.world) ctx.log("all {d} ranks joined: ready", .{reg.world});

    // Hold the connection until the follower goes.
    _ = r.discardRemaining() catch {};
    _ = reg.mask.fetchAnd(~bit, .acq_rel);
    ctx.refuse("rank {d} went away (its connection from {s} closed); a tensor-parallel group does not survive that", .{ rank, peer });
}

fn refuseJoin(reg: *Registry, w: *Io.Writer, peer: []const u8, comptime fmt: []const u8, args: anytype) void {
    var buf: [256]u8 = undefined;
    const why = std.fmt.bufPrint(&buf, fmt, args) catch "refused";
    reg.ctx.log("refused a follower from {s}: {s}", .{ peer, why });
    w.print("REFUSED {s}\n", .{why}) catch {};
    w.flush() catch {};
}

// ------------------------------------------------------------------------------ followers

pub const DialOptions = struct {
    /// Give up after this long (null: retry forever).
    timeout_s: ?u32 = null,
    /// What to call the peer in the retry log lines.
    what: []const u8 = "head",
};

pub const DialOutcome = enum { timed_out };

/// Dial host:port every second until it answers, join as `rank` of `world`, then hold the
/// connection: returns only on timeout; exits 1 when refused or when the head goes away.
pub fn follow(ctx: *const Ctx, family: Family, host: []const u8, port: u16, rank: u32, world: u32, opts: DialOptions) DialOutcome {
    const io = ctx.io;
    const start = Io.Timestamp.now(io, .awake);
    var attempt: u64 = 0;
    while (true) : (attempt += 1) {
        if (opts.timeout_s) |limit| {
            const elapsed = start.untilNow(io, .awake).toSeconds();
            if (elapsed >= limit) return .timed_out;
        }
        const stream = connect(io, host, port) catch |e| {
            ctx.log("{s} {s}:{d}: {t}; retrying in 1s", .{ opts.what, host, port, e });
            io.sleep(.fromSeconds(1), .awake) catch {};
            continue;
        };
        var recv_buf: [512]u8 = undefined;
        var send_buf: [512]u8 = undefined;
        var sr = stream.reader(io, &recv_buf);
        var sw = stream.writer(io, &send_buf);
        const r = &sr.interface;
        const w = &sw.interface;
        w.print("JOIN {s} {d} {d}\n", .{ family.word(), rank, world }) catch {};
        w.flush() catch {};
        const line = (r.takeDelimiter('\n') catch null) orelse {
            stream.close(io);
            ctx.log("{s} {s}:{d} closed the connection before answering; retrying in 1s", .{ opts.what, host, port });
            io.sleep(.fromSeconds(1), .awake) catch {};
            continue;
        };
        if (std.mem.startsWith(u8, line, "REFUSED")) {
            ctx.refuse("{s} {s}:{d} refused rank {d} of {d}: {s}", .{ opts.what, host, port, rank, world, std.mem.trim(u8, line[7..], " \r") });
        }
        if (!std.mem.startsWith(u8, line, "OK")) {
            ctx.refuse("{s} {s}:{d} answered '{s}': not a {s} rendezvous", .{ opts.what, host, port, line, family.word() });
        }
        ctx.log("joined {s} {s}:{d} as rank {d} of {d}", .{ opts.what, host, port, rank, world });
        _ = r.discardRemaining() catch {};
        ctx.refuse("{s} went away ({s}:{d} closed the connection)", .{ opts.what, host, port });
    }
}

/// Connect to a numeric address, or resolve a host name.
pub fn connect(io: Io, host: []const u8, port: u16) !Io.net.Stream {
    if (Io.net.IpAddress.parse(host, port)) |addr| {
        return addr.connect(io, .{ .mode = .stream });
    } else |_| {
        const hn = try Io.net.HostName.init(host);
        return hn.connect(io, port, .{ .mode = .stream });
    }
}
