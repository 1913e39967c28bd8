//! /probe.conf: "ifaces" (print /proc/net/dev's interfaces; exit 1 if any but lo) or
//! "connect A.B.C.D:PORT" (exit 3 if a TCP connect fails). Raw Linux syscalls only.
const std = @import("std");
const linux = std.os.linux;

fn out(s: []const u8) void {
    _ = linux.write(1, s.ptr, s.len);
}

fn readFile(path: [*:0]const u8, buf: []u8) ?[]u8 {
    const rc = linux.open(path, .{ .ACCMODE = .RDONLY }, 0);
    if (linux.errno(rc) != .SUCCESS) return null;
    const fd: i32 = @intCast(rc);
    var n: usize = 0;
    while (n < buf.len) {
        const r = linux.read(fd, buf[n..].ptr, buf.len - n);
        if (linux.errno(r) != .SUCCESS or r == 0) break;
        n += r;
    }
    _ = linux.close(fd);
    return buf[0..n];
}

fn ifaces() u8 {
    var buf: [16384]u8 = undefined;
    const dev = readFile("/proc/net/dev", &buf) orelse {
        out("probe: cannot read /proc/net/dev\n");
        return 2;
    };
    var others: usize = 0;
    var lines = std.mem.splitScalar(u8, dev, '\n');
    while (lines.next()) |line| {
        const colon = std.mem.indexOfScalar(u8, line, ':') orelse continue;
        const name = std.mem.trim(u8, line[0..colon], " ");
        out("probe: interface ");
        out(name);
        out("\n");
        if (!std.mem.eql(u8, name, "lo")) others += 1;
    }
    return if (others == 0) 0 else 1;
}

fn connect(spec: []const u8) u8 {
    const colon = std.mem.lastIndexOfScalar(u8, spec, ':') orelse return 2;
    const port = std.fmt.parseInt(u16, spec[colon + 1 ..], 10) catch return 2;
    var octets: [4]u8 = undefined;
    var it = std.mem.splitScalar(u8, spec[0..colon], '.');
    for (&octets) |*o| o.* = std.fmt.parseInt(u8, it.next() orelse return 2, 10) catch return 2;
    const s = linux.socket(linux.AF.INET, linux.SOCK.STREAM, 0);
    if (linux.errno(s) != .SUCCESS) {
        out("probe: no socket\n");
        return 3;
    }
    const addr = linux.sockaddr.in{ .port = std.mem.nativeToBig(u16, port), .addr = @bitCast(octets) };
    const rc = linux.connect(@intCast(s), &addr, @sizeOf(linux.sockaddr.in));
    if (linux.errno(rc) != .SUCCESS) {
        out("probe: cannot reach ");
        out(spec);
        out(": ");
        out(@tagName(linux.errno(rc)));
        out("\n");
        return 3;
    }
    out("probe: reached ");
    out(spec);
    out("\n");
    return 0;
}

pub fn main() u8 {
    var conf_buf: [256]u8 = undefined;
    const conf = std.mem.trim(u8, readFile("/probe.conf", &conf_buf) orelse "", " \r\n");
    if (std.mem.eql(u8, conf, "ifaces")) return ifaces();
    if (std.mem.startsWith(u8, conf, "connect ")) return connect(conf["connect ".len..]);
    out("probe: /probe.conf must say `ifaces` or `connect A.B.C.D:PORT`\n");
    return 2;
}
