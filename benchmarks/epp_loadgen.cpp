// An open-loop ext_proc load generator in C++: the stand-in for Envoy's ext_proc filter in
// benchmarks/epp_latency.py (`--client cpp`). Built at run time by epp_latency.py with g++ (-O2).
//
// What it does, and no more (cleartext HTTP/2 with prior knowledge, one process, one thread, epoll):
//   * N connections (--conns); streams go round-robin over them, as Envoy's worker threads each hold one;
//   * the schedule is fixed before the run: arrival times drawn from a Poisson process (exponential gaps,
//     seeded) or evenly spaced; a stream's latency is measured from its *intended* send time (the schedule),
//     so a late client (coordinated omission) is not hidden: `sent - due` is the client's own lag, reported apart;
//   * every frame pre-encoded: a HEADERS block of HPACK literals without indexing (no dynamic table, so the
//     same bytes every time; the stream id patched in), each gRPC message one DATA frame with its 5-byte prefix;
//     the request headers message, the body message (one per request, serialized by the Python side), the
//     response-path messages;
//   * timers: one timerfd (CLOCK_MONOTONIC, absolute) armed at the earlier of the next arrival and the next
//     per-stream step (the simulated TTFT and decode), timer slack 1 us;
//   * time stamps with CLOCK_MONOTONIC (the clock Python's perf_counter reads, so the picker's own stamps are
//     on the same clock): due (schedule), sent (after the write(2) that carried the stream's HEADERS), first
//     (after the read(2) that carried the first answer message), end (the server's trailers);
//   * the server's frames parsed only as far as needed: DATA split into gRPC messages; the first message
//     classified (ImmediateResponse: its HTTP status; else a pick: the endpoint named in the
//     x-gateway-destination-endpoint header mutation); HEADERS with END_STREAM end a stream (the server's
//     trailers; their HPACK is not decoded: a stream that ends before all its answers came is an error);
//     SETTINGS acknowledged, PING answered, WINDOW_UPDATE tracked (a write past the server's window is a fatal
//     error here: the picker grants 16 MiB and credits it back, far above what a run sends in flight),
//     RST_STREAM / GOAWAY counted as errors.
//
// Usage: epp_loadgen HOST PORT RATE N SEED TTFT_US DECODE_US PATTERN(full|resp-headers) CHUNKS CONNS
//                    SCHEDULE(poisson|uniform) INFILE OUTFILE
// INFILE: u32 count, then count x (u32 length, bytes): request-headers message, response-headers message,
// first chunk message, last chunk message, then N body messages (serialized ProcessingRequest protobufs).
// OUTFILE: one CSV line per request: i,port (the connection's local port),sid,due_ns,sent_ns,first_ns,end_ns,outcome,endpoint
// (outcome: HTTP status of the answer, 200 for a pick; negative: an error, see ERRORS below).
// stdout: one JSON line with the client's own CPU seconds and counts.

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <queue>
#include <random>
#include <string>
#include <vector>

static const int E_RESET = -1, E_EARLY_END = -2, E_NO_ENDPOINT = -3, E_GOAWAY = -4, E_TIMEOUT = -5;

static int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

[[noreturn]] static void die(const char *what) {
  fprintf(stderr, "epp_loadgen: %s (%s)\n", what, strerror(errno));
  exit(2);
}

enum { DATA = 0, HEADERS = 1, RST_STREAM = 3, SETTINGS = 4, PING = 6, GOAWAY = 7, WINDOW_UPDATE = 8, CONTINUATION = 9 };
enum { END_STREAM = 1, ACK = 1, END_HEADERS = 4, PADDED = 8, PRIO = 0x20 };
static const uint32_t MAX_WINDOW = 0x7fffffff;

static void put_frame_head(std::string &out, uint32_t len, uint8_t kind, uint8_t flags, uint32_t sid) {
  char h[9] = {char(len >> 16), char(len >> 8), char(len), char(kind), char(flags),
               char(sid >> 24), char(sid >> 16), char(sid >> 8), char(sid)};
  out.append(h, 9);
}

static void hpack_int(std::string &out, uint32_t v, int prefix, uint8_t first) {
  uint32_t limit = (1u << prefix) - 1;
  if (v < limit) { out.push_back(char(first | v)); return; }
  out.push_back(char(first | limit));
  v -= limit;
  while (v >= 128) { out.push_back(char((v & 0x7f) | 0x80)); v >>= 7; }
  out.push_back(char(v));
}

static void literal(std::string &out, const std::string &name, const std::string &value) {
  out.push_back(0);
  hpack_int(out, name.size(), 7, 0);
  out += name;
  hpack_int(out, value.size(), 7, 0);
  out += value;
}

static std::string grpc_data(const std::string &msg, uint32_t sid, uint8_t flags) {
  std::string out;
  put_frame_head(out, msg.size() + 5, DATA, flags, sid);
  uint32_t n = msg.size();
  char p[5] = {0, char(n >> 24), char(n >> 16), char(n >> 8), char(n)};
  out.append(p, 5);
  out += msg;
  return out;
}

static void patch_sid(std::string &out, size_t at, uint32_t sid) {  // the stream id of the frame at `at`
  out[at + 5] = char(sid >> 24); out[at + 6] = char(sid >> 16); out[at + 7] = char(sid >> 8); out[at + 8] = char(sid);
}

static bool varint(const uint8_t *&p, const uint8_t *end, uint64_t &v) {
  v = 0;
  for (int shift = 0; p < end && shift < 64; shift += 7) {
    uint8_t b = *p++;
    v |= uint64_t(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

struct Step {  // after the previous answer: wait `delay`, send message `msg` (-1: END_STREAM), expect one answer
  int64_t delay;
  int msg;
};

struct Stream {
  int conn = 0;
  uint32_t sid = 0;
  int64_t due = 0, sent = 0, first = 0, end = 0;
  int outcome = 0;
  std::string endpoint;
  std::string rx;       // a gRPC message split across DATA frames
  int answers = 0;      // gRPC messages received
  int step = -1;        // the last step sent (-1: only the request so far)
  bool done = false;
};

struct Conn {
  int fd = -1;
  std::string out;
  std::string in;
  std::vector<int> opened;       // streams whose HEADERS are in `out` (stamped `sent` at the write)
  std::vector<int> by_sid;       // (sid - 1) / 2 -> stream index
  uint32_t next_sid = 1;
  int64_t send_window = 65535;   // the connection's, as the server grants it
  uint32_t peer_initial = 65535; // the server's SETTINGS_INITIAL_WINDOW_SIZE (per stream)
  uint64_t unacked_in = 0;
  bool settings_seen = false;
  bool want_out = false;
  int64_t goaway_last = -1;
  int local_port = 0;            // (the server's traces name a connection by its peer's port)
};

struct Gen {
  std::vector<Conn> conns;
  std::vector<Stream> streams;
  std::vector<std::string> msgs;     // 0 headers, 1 response headers, 2 first chunk, 3 last chunk
  std::vector<std::string> bodies;   // one DATA frame each (sid patched at send)
  std::string headers_frame;         // HEADERS with the pre-encoded block (sid patched at send)
  std::vector<std::string> step_frames;  // per message index: its DATA frame (sid patched at send)
  std::vector<Step> steps;
  std::priority_queue<std::pair<int64_t, int>, std::vector<std::pair<int64_t, int>>, std::greater<>> timers;
  int finished = 0;
  int errors = 0;
  int epfd = -1, tfd = -1;
  int64_t armed = -1;

  void send_data(int si, const std::string &frame) {
    Stream &s = streams[si];
    Conn &c = conns[s.conn];
    int64_t n = int64_t(frame.size()) - 9;
    if (n > c.send_window || n > int64_t(c.peer_initial)) {
      errno = 0;
      die("a DATA frame past the server's flow-control window (not handled by this client)");
    }
    c.send_window -= n;
    size_t at = c.out.size();
    c.out += frame;
    patch_sid(c.out, at, s.sid);
  }

  void open(int si) {
    Stream &s = streams[si];
    Conn &c = conns[s.conn];
    if (c.goaway_last >= 0) { finish(si, E_GOAWAY, now_ns()); return; }
    s.sid = c.next_sid;
    c.next_sid += 2;
    c.by_sid.push_back(si);
    size_t at = c.out.size();
    c.out += headers_frame;
    patch_sid(c.out, at, s.sid);
    send_data(si, step_frames[0]);
    send_data(si, bodies[si]);
    c.opened.push_back(si);
  }

  void finish(int si, int outcome, int64_t t) {
    Stream &s = streams[si];
    if (s.done) return;
    s.done = true;
    if (outcome < 0 || s.outcome == 0) s.outcome = outcome;
    if (outcome < 0) errors++;
    s.end = t;
    finished++;
  }

  void do_step(int si) {  // the next step of the response path
    Stream &s = streams[si];
    if (s.done) return;
    s.step++;
    const Step &st = steps[s.step];
    if (st.msg < 0) {
      std::string f;
      put_frame_head(f, 0, DATA, END_STREAM, s.sid);
      conns[s.conn].out += f;
    } else {
      send_data(si, step_frames[st.msg]);
    }
  }

  void schedule_next(int si, int64_t t) {  // an answer came: the next step after its delay
    Stream &s = streams[si];
    if (s.step + 1 >= int(steps.size())) return;
    const Step &st = steps[s.step + 1];
    if (st.delay <= 0) do_step(si);
    else timers.push({t + st.delay, si});
  }

  void message(int si, const std::string &m, int64_t t) {
    Stream &s = streams[si];
    s.answers++;
    if (s.answers == 1) {
      s.first = t;
      const uint8_t *p = (const uint8_t *)m.data(), *end = p + m.size();
      if (!m.empty() && p[0] == 0x3a) {  // ProcessingResponse.immediate_response (field 7)
        uint64_t len, v;
        p++;
        int code = 0;
        if (varint(p, end, len) && p < end && *p == 0x0a) {  // .status (HttpStatus, field 1)
          p++;
          if (varint(p, end, len) && p < end && *p == 0x08) {  // .code (field 1)
            p++;
            if (varint(p, end, v)) code = int(v);
          }
        }
        s.outcome = code ? code : E_NO_ENDPOINT;
        // cancel the stream, as Envoy does once it has the immediate response
        std::string f;
        put_frame_head(f, 4, RST_STREAM, 0, s.sid);
        f.append("\0\0\0\x08", 4);
        conns[s.conn].out += f;
        finish(si, s.outcome, t);
        return;
      }
      static const std::string key = "x-gateway-destination-endpoint";
      size_t at = m.find(key);
      if (at != std::string::npos && at + key.size() < m.size() && uint8_t(m[at + key.size()]) == 0x1a) {
        const uint8_t *q = (const uint8_t *)m.data() + at + key.size() + 1;
        uint64_t len;
        if (varint(q, end, len) && q + len <= end) s.endpoint.assign((const char *)q, len);
      }
      s.outcome = s.endpoint.empty() ? E_NO_ENDPOINT : 200;
      if (s.outcome < 0) finish(si, s.outcome, t);
      return;  // the body passthrough comes next
    }
    if (s.answers == 2 || s.step >= 0) schedule_next(si, t);
  }

  void data(int si, const uint8_t *p, size_t n, int64_t t) {
    Stream &s = streams[si];
    s.rx.append((const char *)p, n);
    size_t pos = 0;
    while (s.rx.size() - pos >= 5) {
      uint32_t len = uint32_t(uint8_t(s.rx[pos + 1])) << 24 | uint32_t(uint8_t(s.rx[pos + 2])) << 16 |
                     uint32_t(uint8_t(s.rx[pos + 3])) << 8 | uint8_t(s.rx[pos + 4]);
      if (s.rx.size() - pos < 5 + len) break;
      std::string m = s.rx.substr(pos + 5, len);
      pos += 5 + len;
      if (!s.done) message(si, m, t);
    }
    s.rx.erase(0, pos);
  }

  int stream_of(Conn &c, uint32_t sid) {
    if (!(sid & 1)) return -1;
    size_t k = (sid - 1) / 2;
    return k < c.by_sid.size() ? c.by_sid[k] : -1;
  }

  void frames(int ci, int64_t t) {
    Conn &c = conns[ci];
    size_t pos = 0, n = c.in.size();
    const uint8_t *b = (const uint8_t *)c.in.data();
    while (n - pos >= 9) {
      uint32_t len = uint32_t(b[pos]) << 16 | uint32_t(b[pos + 1]) << 8 | b[pos + 2];
      if (n - pos < 9 + len) break;
      uint8_t kind = b[pos + 3], flags = b[pos + 4];
      uint32_t sid = (uint32_t(b[pos + 5]) << 24 | uint32_t(b[pos + 6]) << 16 | uint32_t(b[pos + 7]) << 8 | b[pos + 8]) &
                     0x7fffffff;
      const uint8_t *p = b + pos + 9;
      pos += 9 + len;
      int si = sid ? stream_of(c, sid) : -1;
      switch (kind) {
        case DATA: {
          c.unacked_in += len;
          if (c.unacked_in > (1u << 20)) {
            std::string f;
            put_frame_head(f, 4, WINDOW_UPDATE, 0, 0);
            uint32_t v = c.unacked_in;
            char w[4] = {char(v >> 24), char(v >> 16), char(v >> 8), char(v)};
            f.append(w, 4);
            c.out += f;
            c.unacked_in = 0;
          }
          const uint8_t *q = p;
          uint32_t m = len;
          if (flags & PADDED) { if (!len || p[0] >= len) break; m = len - 1 - p[0]; q = p + 1; }
          if (si >= 0) {
            data(si, q, m, t);
            if (flags & END_STREAM) finish(si, E_EARLY_END, t);  // gRPC ends a stream with trailers
          }
          break;
        }
        case HEADERS:
        case CONTINUATION:
          // response headers, or trailers (END_STREAM): the end of the stream. Not decoded (see the top).
          if (kind == HEADERS && (flags & END_STREAM) && si >= 0) {
            Stream &s = streams[si];
            bool complete = s.outcome == 200 && s.step == int(steps.size()) - 1;
            finish(si, complete ? 200 : E_EARLY_END, t);
          }
          break;
        case SETTINGS:
          if (flags & ACK) break;
          for (uint32_t k = 0; k + 6 <= len; k += 6) {
            uint16_t id = uint16_t(p[k]) << 8 | p[k + 1];
            uint32_t v = uint32_t(p[k + 2]) << 24 | uint32_t(p[k + 3]) << 16 | uint32_t(p[k + 4]) << 8 | p[k + 5];
            if (id == 4) c.peer_initial = v;
          }
          {
            std::string f;
            put_frame_head(f, 0, SETTINGS, ACK, 0);
            c.out += f;
          }
          c.settings_seen = true;
          break;
        case PING:
          if (!(flags & ACK) && len == 8) {
            std::string f;
            put_frame_head(f, 8, PING, ACK, 0);
            f.append((const char *)p, 8);
            c.out += f;
          }
          break;
        case WINDOW_UPDATE:
          if (len == 4 && sid == 0)
            c.send_window += (uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]) & 0x7fffffff;
          break;
        case RST_STREAM:
          if (si >= 0) finish(si, E_RESET, t);
          break;
        case GOAWAY:
          if (len >= 8) {
            c.goaway_last = (uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]) & 0x7fffffff;
            for (size_t k = 0; k < c.by_sid.size(); k++)
              if (2 * k + 1 > uint64_t(c.goaway_last)) finish(c.by_sid[k], E_GOAWAY, t);
          }
          break;
        default:
          break;
      }
    }
    c.in.erase(0, pos);
  }

  void flush(int ci) {
    Conn &c = conns[ci];
    while (!c.out.empty()) {
      ssize_t w = write(c.fd, c.out.data(), c.out.size());
      if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        if (errno == EINTR) continue;
        die("write");
      }
      c.out.erase(0, size_t(w));
    }
    if (!c.opened.empty() && c.out.empty()) {  // the HEADERS (and the request) all handed to the kernel
      int64_t t = now_ns();
      for (int si : c.opened) streams[si].sent = t;
      c.opened.clear();
    }
    bool want = !c.out.empty();
    if (want != c.want_out) {
      epoll_event ev{};
      ev.events = want ? uint32_t(EPOLLIN | EPOLLOUT) : uint32_t(EPOLLIN);
      ev.data.u32 = uint32_t(ci);
      if (epoll_ctl(epfd, EPOLL_CTL_MOD, c.fd, &ev) < 0) die("epoll_ctl");
      c.want_out = want;
    }
  }

  bool read_conn(int ci) {  // false: the connection closed
    Conn &c = conns[ci];
    char buf[65536];
    for (;;) {
      ssize_t r = read(c.fd, buf, sizeof buf);
      if (r > 0) {
        int64_t t = now_ns();
        c.in.append(buf, size_t(r));
        frames(ci, t);
        continue;
      }
      if (r == 0) return false;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      if (errno == EINTR) continue;
      return false;
    }
  }

  void arm(int64_t at) {
    if (at == armed) return;
    armed = at;
    itimerspec its{};
    if (at > 0) {
      its.it_value.tv_sec = at / 1000000000LL;
      its.it_value.tv_nsec = at % 1000000000LL;
    }
    if (timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, nullptr) < 0) die("timerfd_settime");
  }
};

static std::string read_all(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) die("cannot open the input file");
  std::string s;
  char buf[65536];
  size_t r;
  while ((r = fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, r);
  fclose(f);
  return s;
}

int main(int argc, char **argv) {
  if (argc != 14) {
    fprintf(stderr, "usage: epp_loadgen HOST PORT RATE N SEED TTFT_US DECODE_US full|resp-headers CHUNKS CONNS "
                    "poisson|uniform INFILE OUTFILE\n");
    return 2;
  }
  const char *host = argv[1];
  int port = atoi(argv[2]);
  double rate = atof(argv[3]);
  int n = atoi(argv[4]);
  uint64_t seed = strtoull(argv[5], nullptr, 10);
  int64_t ttft = int64_t(atof(argv[6]) * 1000), decode = int64_t(atof(argv[7]) * 1000);
  std::string pattern = argv[8];
  int chunks = atoi(argv[9]), nconn = atoi(argv[10]);
  std::string schedule = argv[11];
  if (rate <= 0 || n <= 0 || nconn <= 0 || (pattern != "full" && pattern != "resp-headers") ||
      (schedule != "poisson" && schedule != "uniform")) {
    fprintf(stderr, "epp_loadgen: bad arguments\n");
    return 2;
  }
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);

  Gen g;
  // -- the messages
  std::string in = read_all(argv[12]);
  size_t at = 0;
  auto u32 = [&](void) -> uint32_t {
    if (at + 4 > in.size()) { errno = 0; die("truncated input file"); }
    uint32_t v;
    memcpy(&v, in.data() + at, 4);
    at += 4;
    return v;
  };
  uint32_t count = u32();
  if (count != uint32_t(4 + n)) { errno = 0; die("the input file has not 4 + N messages"); }
  std::vector<std::string> all;
  for (uint32_t k = 0; k < count; k++) {
    uint32_t len = u32();
    if (at + len > in.size()) { errno = 0; die("truncated input file"); }
    all.emplace_back(in.substr(at, len));
    at += len;
  }
  for (int k = 0; k < 4; k++) g.step_frames.push_back(grpc_data(all[k], 0, 0));
  for (int k = 0; k < n; k++) g.bodies.push_back(grpc_data(all[4 + k], 0, 0));
  std::string authority = std::string(host) + ":" + std::to_string(port);
  std::string block;
  literal(block, ":method", "POST");
  literal(block, ":scheme", "http");
  literal(block, ":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process");
  literal(block, ":authority", authority);
  literal(block, "content-type", "application/grpc");
  literal(block, "te", "trailers");
  put_frame_head(g.headers_frame, block.size(), HEADERS, END_HEADERS, 0);
  g.headers_frame += block;
  // the response path, as epp_latency.py's Python clients play it
  if (pattern == "full") {
    int64_t gap = decode / (chunks > 1 ? chunks - 1 : 1);
    g.steps.push_back({ttft, 1});
    g.steps.push_back({0, 2});
    for (int k = 0; k < chunks - 2; k++) g.steps.push_back({gap, 2});
    g.steps.push_back({gap, 3});
    g.steps.push_back({0, -1});
  } else {
    g.steps.push_back({ttft, 1});
    g.steps.push_back({decode, -1});
  }

  // -- connections
  g.epfd = epoll_create1(0);
  g.tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
  if (g.epfd < 0 || g.tfd < 0) die("epoll/timerfd");
  epoll_event tev{};
  tev.events = EPOLLIN;
  tev.data.u32 = 0xffffffffu;
  epoll_ctl(g.epfd, EPOLL_CTL_ADD, g.tfd, &tev);
  g.conns.resize(nconn);
  for (int ci = 0; ci < nconn; ci++) {
    Conn &c = g.conns[ci];
    c.fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) { errno = 0; die("HOST must be an IPv4 address"); }
    if (connect(c.fd, (sockaddr *)&a, sizeof a) < 0) die("connect");
    int one = 1;
    setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    sockaddr_in local{};
    socklen_t ll = sizeof local;
    if (getsockname(c.fd, (sockaddr *)&local, &ll) == 0) c.local_port = ntohs(local.sin_port);
    fcntl(c.fd, F_SETFL, O_NONBLOCK);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u32 = uint32_t(ci);
    if (epoll_ctl(g.epfd, EPOLL_CTL_ADD, c.fd, &ev) < 0) die("epoll_ctl");
    c.out = std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 24);
    std::string f;
    put_frame_head(f, 12, SETTINGS, 0, 0);
    const char s[12] = {0, 2, 0, 0, 0, 0, 0, 4, char(0x7f), char(0xff), char(0xff), char(0xff)};  // no push; window
    f.append(s, 12);
    put_frame_head(f, 4, WINDOW_UPDATE, 0, 0);
    uint32_t inc = MAX_WINDOW - 65535;
    char w[4] = {char(inc >> 24), char(inc >> 16), char(inc >> 8), char(inc)};
    f.append(w, 4);
    c.out += f;
    g.flush(ci);
  }
  // the servers' SETTINGS first (their windows), then the schedule
  epoll_event evs[64];
  int64_t hs_deadline = now_ns() + 10000000000LL;
  for (;;) {
    bool all_seen = true;
    for (auto &c : g.conns) all_seen &= c.settings_seen;
    if (all_seen) break;
    if (now_ns() > hs_deadline) { errno = 0; die("no SETTINGS from the server within 10 s"); }
    int k = epoll_wait(g.epfd, evs, 64, 100);
    for (int e = 0; e < k; e++) {
      uint32_t ci = evs[e].data.u32;
      if (ci == 0xffffffffu) continue;
      if (!g.read_conn(int(ci))) { errno = 0; die("the server closed the connection during the handshake"); }
      g.flush(int(ci));
    }
  }

  // -- the schedule, fixed before the run
  g.streams.resize(n);
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(rate);
  int64_t start = now_ns() + 200000000LL;
  double t = 0;
  for (int i = 0; i < n; i++) {
    g.streams[i].due = start + int64_t(t * 1e9);
    g.streams[i].conn = i % nconn;
    t += schedule == "poisson" ? gap(rng) : 1.0 / rate;
  }
  rusage ru0;
  getrusage(RUSAGE_SELF, &ru0);
  int next = 0;
  int64_t deadline = g.streams[n - 1].due + 60000000000LL;
  while (g.finished < n) {
    int64_t now = now_ns();
    if (now > deadline) {
      for (int i = 0; i < n; i++) g.finish(i, E_TIMEOUT, now);
      break;
    }
    while (next < n && g.streams[next].due <= now) g.open(next++);
    while (!g.timers.empty() && g.timers.top().first <= now) {
      int si = g.timers.top().second;
      g.timers.pop();
      g.do_step(si);
    }
    for (int ci = 0; ci < nconn; ci++) g.flush(ci);
    int64_t wake = deadline;
    if (next < n) wake = std::min(wake, g.streams[next].due);
    if (!g.timers.empty()) wake = std::min(wake, g.timers.top().first);
    int timeout = -1;
    if (wake <= now_ns()) timeout = 0;
    else g.arm(wake);
    int k = epoll_wait(g.epfd, evs, 64, timeout);
    if (k < 0 && errno != EINTR) die("epoll_wait");
    for (int e = 0; e < k; e++) {
      uint32_t ci = evs[e].data.u32;
      if (ci == 0xffffffffu) {
        uint64_t x;
        ssize_t r = read(g.tfd, &x, sizeof x);
        (void)r;
        g.armed = -1;
        continue;
      }
      if (evs[e].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
        if (!g.read_conn(int(ci))) {
          int64_t tt = now_ns();
          for (int i = 0; i < n; i++)
            if (g.streams[i].conn == int(ci) && g.streams[i].sid) g.finish(i, E_RESET, tt);
          epoll_ctl(g.epfd, EPOLL_CTL_DEL, g.conns[ci].fd, nullptr);
          g.conns[ci].goaway_last = 0;
        }
      }
      g.flush(int(ci));
    }
  }
  rusage ru1;
  getrusage(RUSAGE_SELF, &ru1);
  double cpu = (ru1.ru_utime.tv_sec - ru0.ru_utime.tv_sec) + (ru1.ru_utime.tv_usec - ru0.ru_utime.tv_usec) / 1e6 +
               (ru1.ru_stime.tv_sec - ru0.ru_stime.tv_sec) + (ru1.ru_stime.tv_usec - ru0.ru_stime.tv_usec) / 1e6;
  int64_t wall_end = now_ns();
  for (auto &c : g.conns) {  // GOAWAY, as a client that is done
    std::string f;
    put_frame_head(f, 8, GOAWAY, 0, 0);
    f.append("\0\0\0\0\0\0\0\0", 8);
    ssize_t r = write(c.fd, f.data(), f.size());
    (void)r;
    close(c.fd);
  }
  FILE *o = fopen(argv[13], "w");
  if (!o) die("cannot write the output file");
  for (int i = 0; i < n; i++) {
    const Stream &s = g.streams[i];
    fprintf(o, "%d,%d,%u,%lld,%lld,%lld,%lld,%d,%s\n", i, g.conns[s.conn].local_port, s.sid, (long long)s.due, (long long)s.sent,
            (long long)s.first, (long long)s.end, s.outcome, s.endpoint.c_str());
  }
  fclose(o);
  printf("{\"cpu_s\": %.6f, \"wall_s\": %.6f, \"start_ns\": %lld, \"errors\": %d}\n", cpu, (wall_end - start) / 1e9,
         (long long)start, g.errors);
  return 0;
}
