// gopeer: a yamux peer built on Debian's hashicorp/yamux (df201c7) for the
// interop tests in tests/interop. It runs exactly one yamux session over TCP or
// over a WebSocket (gorilla/websocket, binary messages), reports what happens
// as JSON lines on stdout and takes commands as JSON lines on stdin.
//
// Build (offline, GOPATH mode, Debian packages):
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o gopeer main.go
//
// Stream conventions (shared with tests/interop):
//
//   - Streams the peer opens to us are echoed (-echo, default on): Go reads
//     until EOF (the peer's FIN), computes sha256, writes everything back and
//     only then closes. Go never closes before it has read (see yamux-wire.md
//     7.14: this Go version cannot read after its own Close).
//   - Streams Go opens ("open" command / -open flag) carry a 40-byte header
//     (8-byte big-endian payload length, 32-byte sha256 of the payload) then
//     the payload. The peer is expected to echo everything (header included)
//     and then close its side; Go reads until EOF, verifies length and sha256,
//     and only then closes.
//   - "write" command: Go opens a stream and writes raw bytes in chunks,
//     counting what the yamux Write accepted; a watchdog reports a stall (the
//     peer's window is exhausted). Then Go closes (FIN).
//
// Events (stdout), one JSON object per line, always with "event":
//
//	listening{addr}, connected{local,remote}, session_started, accepted{id},
//	echoed{id,bytes,sha256,err?}, opened{tag,index,id}, open_failed{tag,index,err},
//	open_result{tag,index,id,ok,bytes,sha256,err?}, open_done{tag,ok,failed},
//	write_stalled{tag,id,written}, write_done{tag,id,written,sha256,err?},
//	goaway_sent{err?}, pong{rtt_ms} / ping_failed{err}, stats{...},
//	frame_in{...} (only for go-away and RST frames), transport_read_end{err},
//	yamux_log{msg}, session_closed{...}, error{msg}
//
// Commands (stdin), one JSON object per line, with "cmd":
//
//	open{n,size,tag}, write{size,chunk,tag}, goaway, ping, stats, close
package main

import (
	"bufio"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math/rand"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"
	"github.com/hashicorp/yamux"
)

// ---------------------------------------------------------------- reporting

var outMu sync.Mutex

// traceFrames (-trace) reports every frame header seen in either direction.
var traceFrames bool

func report(event string, kv map[string]interface{}) {
	if kv == nil {
		kv = map[string]interface{}{}
	}
	kv["event"] = event
	kv["t"] = time.Now().UnixNano() / 1e6
	b, err := json.Marshal(kv)
	if err != nil {
		b = []byte(fmt.Sprintf(`{"event":"error","msg":%q}`, err.Error()))
	}
	outMu.Lock()
	os.Stdout.Write(append(b, '\n'))
	outMu.Unlock()
}

func errStr(err error) interface{} {
	if err == nil {
		return nil
	}
	return err.Error()
}

// logWriter turns yamux's log lines into events.
type logWriter struct{}

func (logWriter) Write(p []byte) (int, error) {
	for _, line := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		if line != "" {
			report("yamux_log", map[string]interface{}{"msg": line})
		}
	}
	return len(p), nil
}

// ---------------------------------------------------------------- frame tap

// frameParser follows yamux frames in one direction of the byte stream
// without altering it, to count frame types and notice go-away / RST.
type frameParser struct {
	dir     string
	hdr     [12]byte
	have    int
	skip    uint32
	mu      sync.Mutex
	counts  map[string]int
	goaways []uint32
	recent  map[uint32][]string // last frames per stream, for failure reports
}

const recentPerStream = 48

func newParser(dir string) *frameParser {
	return &frameParser{dir: dir, counts: map[string]int{}, recent: map[uint32][]string{}}
}

func (p *frameParser) feed(b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(b) > 0 {
		if p.skip > 0 {
			n := uint32(len(b))
			if n > p.skip {
				n = p.skip
			}
			p.skip -= n
			b = b[n:]
			continue
		}
		n := copy(p.hdr[p.have:], b)
		p.have += n
		b = b[n:]
		if p.have < 12 {
			return
		}
		p.have = 0
		typ := p.hdr[1]
		flags := binary.BigEndian.Uint16(p.hdr[2:4])
		id := binary.BigEndian.Uint32(p.hdr[4:8])
		length := binary.BigEndian.Uint32(p.hdr[8:12])
		if id != 0 {
			r := append(p.recent[id], fmt.Sprintf("%s t=%d f=%d len=%d", p.dir, typ, flags, length))
			if len(r) > recentPerStream {
				r = r[len(r)-recentPerStream:]
			}
			p.recent[id] = r
		}
		if traceFrames {
			report("trace", map[string]interface{}{"dir": p.dir, "type": typ, "flags": flags, "id": id, "length": length})
		}
		switch typ {
		case 0:
			p.counts["data"]++
			if length == 0 && flags == 0 {
				p.counts["data_empty_noflags"]++ // carries nothing at all
			}
			if flags&4 != 0 && length > 0 {
				// FIN riding on a frame with payload: df201c7 processes the FIN before
				// buffering the payload, so a blocked Read can return EOF and lose it.
				p.counts["data_fin_with_payload"]++
			}
			p.skip = length
		case 1:
			p.counts["window_update"]++
		case 2:
			if flags&1 != 0 {
				p.counts["ping_req"]++
			}
			if flags&2 != 0 {
				p.counts["ping_ack"]++
			}
		case 3:
			p.counts["goaway"]++
			p.goaways = append(p.goaways, length)
			report("frame_"+p.dir, map[string]interface{}{"type": "goaway", "code": length})
		default:
			p.counts["unknown"]++
		}
		if typ <= 1 {
			if flags&1 != 0 {
				p.counts["syn"]++
			}
			if flags&2 != 0 {
				p.counts["ack"]++
			}
			if flags&4 != 0 {
				p.counts["fin"]++
			}
			if flags&8 != 0 {
				p.counts["rst"]++
				if p.dir == "in" {
					report("frame_in", map[string]interface{}{"type": "rst", "id": id})
				}
			}
		}
	}
}

func (p *frameParser) framesOf(id uint32) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.recent[id]...)
}

func (p *frameParser) snapshot() map[string]interface{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := map[string]interface{}{}
	for k, v := range p.counts {
		c[k] = v
	}
	g := make([]uint32, len(p.goaways))
	copy(g, p.goaways)
	c["goaway_codes"] = g
	return c
}

type tapConn struct {
	inner     io.ReadWriteCloser
	in, out   *frameParser
	readErrMu sync.Mutex
	readErr   error
}

func (t *tapConn) Read(b []byte) (int, error) {
	n, err := t.inner.Read(b)
	if n > 0 {
		t.in.feed(b[:n])
	}
	if err != nil {
		t.readErrMu.Lock()
		if t.readErr == nil {
			t.readErr = err
			report("transport_read_end", map[string]interface{}{"err": err.Error(), "eof": err == io.EOF})
		}
		t.readErrMu.Unlock()
	}
	return n, err
}

func (t *tapConn) Write(b []byte) (int, error) {
	n, err := t.inner.Write(b)
	if n > 0 {
		t.out.feed(b[:n])
	}
	return n, err
}

func (t *tapConn) Close() error { return t.inner.Close() }

func (t *tapConn) readEnd() (string, bool) {
	t.readErrMu.Lock()
	defer t.readErrMu.Unlock()
	if t.readErr == nil {
		return "", false
	}
	return t.readErr.Error(), t.readErr == io.EOF
}

// ---------------------------------------------------------------- websocket

// wsConn carries the yamux byte stream in binary WebSocket messages.
// Message boundaries mean nothing; a text message ends the session.
type wsConn struct {
	c         *websocket.Conn
	r         io.Reader
	wmu       sync.Mutex
	closeOnce sync.Once
}

func (w *wsConn) Read(p []byte) (int, error) {
	for {
		if w.r == nil {
			mt, r, err := w.c.NextReader()
			if err != nil {
				var ce *websocket.CloseError
				if errors.As(err, &ce) && (ce.Code == websocket.CloseNormalClosure || ce.Code == websocket.CloseGoingAway) {
					return 0, io.EOF
				}
				return 0, err
			}
			if mt != websocket.BinaryMessage {
				// WriteControl may run concurrently with WriteMessage.
				w.c.WriteControl(websocket.CloseMessage,
					websocket.FormatCloseMessage(websocket.CloseUnsupportedData, "binary only"),
					time.Now().Add(time.Second))
				return 0, fmt.Errorf("websocket: non-binary message type %d", mt)
			}
			w.r = r
		}
		n, err := w.r.Read(p)
		if err == io.EOF {
			w.r = nil
			if n > 0 {
				return n, nil
			}
			continue
		}
		return n, err
	}
}

func (w *wsConn) Write(p []byte) (int, error) {
	w.wmu.Lock()
	defer w.wmu.Unlock()
	if err := w.c.WriteMessage(websocket.BinaryMessage, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (w *wsConn) Close() error {
	var err error
	w.closeOnce.Do(func() {
		// Not under wmu: a Write blocked on a stalled peer must not
		// delay the close. WriteControl is safe concurrently.
		w.c.WriteControl(websocket.CloseMessage,
			websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""),
			time.Now().Add(time.Second))
		err = w.c.Close()
	})
	return err
}

// ---------------------------------------------------------------- payloads

func payload(seed int64, size int) []byte {
	b := make([]byte, size)
	rand.New(rand.NewSource(seed)).Read(b)
	return b
}

func hexsum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// ---------------------------------------------------------------- behaviours

type peer struct {
	sess    *yamux.Session
	tap     *tapConn
	echoed  int64
	opened  int64
	writers sync.Map // tag -> *int64 bytes accepted by Write
}

func (p *peer) acceptLoop() {
	for {
		st, err := p.sess.AcceptStream()
		if err != nil {
			return
		}
		report("accepted", map[string]interface{}{"id": st.StreamID()})
		go p.echo(st)
	}
}

func (p *peer) echo(st *yamux.Stream) {
	data, err := io.ReadAll(st)
	ev := map[string]interface{}{"id": st.StreamID(), "bytes": len(data), "sha256": hexsum(data)}
	if err != nil {
		ev["err"] = "read: " + err.Error()
		report("echoed", ev)
		st.Close()
		return
	}
	if len(data) > 0 {
		if _, err := st.Write(data); err != nil {
			ev["err"] = "write: " + err.Error()
		}
	}
	if cerr := st.Close(); cerr != nil && ev["err"] == nil {
		ev["err"] = "close: " + cerr.Error()
	}
	atomic.AddInt64(&p.echoed, 1)
	report("echoed", ev)
}

// openMany opens n streams at once, each carrying size bytes after the
// 40-byte header, and verifies what the peer echoes back.
func (p *peer) openMany(tag string, n, size int) {
	var wg sync.WaitGroup
	var ok, failed int64
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			if p.openOne(tag, i, size) {
				atomic.AddInt64(&ok, 1)
			} else {
				atomic.AddInt64(&failed, 1)
			}
		}(i)
	}
	wg.Wait()
	report("open_done", map[string]interface{}{"tag": tag, "ok": ok, "failed": failed})
}

func (p *peer) openOne(tag string, i, size int) bool {
	st, err := p.sess.OpenStream()
	if err != nil {
		report("open_failed", map[string]interface{}{"tag": tag, "index": i, "err": err.Error()})
		return false
	}
	atomic.AddInt64(&p.opened, 1)
	report("opened", map[string]interface{}{"tag": tag, "index": i, "id": st.StreamID()})
	body := payload(int64(st.StreamID())*7919+int64(i), size)
	sum := sha256.Sum256(body)
	msg := make([]byte, 40+size)
	binary.BigEndian.PutUint64(msg[:8], uint64(size))
	copy(msg[8:40], sum[:])
	copy(msg[40:], body)

	werr := make(chan error, 1)
	go func() {
		_, err := st.Write(msg)
		werr <- err
	}()
	back, rerr := io.ReadAll(st) // until the peer's FIN
	wErr := <-werr
	res := map[string]interface{}{"tag": tag, "index": i, "id": st.StreamID(), "bytes": len(back)}
	okv := rerr == nil && wErr == nil && len(back) == len(msg)
	if len(back) >= 40 {
		res["sha256"] = hexsum(back[40:])
	}
	if okv {
		okv = string(back) == string(msg)
		if !okv {
			res["err"] = "echo differs from what was sent"
		}
	} else if rerr != nil {
		res["err"] = "read: " + rerr.Error()
	} else if wErr != nil {
		res["err"] = "write: " + wErr.Error()
	} else {
		res["err"] = fmt.Sprintf("echo length %d, want %d", len(back), len(msg))
	}
	st.Close() // only after reading everything (7.14)
	res["ok"] = okv
	if !okv {
		res["frames_in"] = p.tap.in.framesOf(st.StreamID())
		res["frames_out"] = p.tap.out.framesOf(st.StreamID())
	}
	report("open_result", res)
	return okv
}

// writeRaw opens a stream and writes size raw bytes in chunks; a watchdog
// reports when Write stops making progress (peer window exhausted).
func (p *peer) writeRaw(tag string, size, chunk int) {
	st, err := p.sess.OpenStream()
	if err != nil {
		report("open_failed", map[string]interface{}{"tag": tag, "err": err.Error()})
		return
	}
	report("opened", map[string]interface{}{"tag": tag, "id": st.StreamID()})
	body := payload(int64(st.StreamID()), size)
	var written int64
	p.writers.Store(tag, &written)
	done := make(chan struct{})
	go func() { // stall watchdog
		last, lastChange, stalled := int64(-1), time.Now(), false
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				w := atomic.LoadInt64(&written)
				if w != last {
					last, lastChange, stalled = w, time.Now(), false
				} else if !stalled && time.Since(lastChange) > 300*time.Millisecond {
					stalled = true
					report("write_stalled", map[string]interface{}{"tag": tag, "id": st.StreamID(), "written": w})
				}
			}
		}
	}()
	var werr error
	for off := 0; off < size; off += chunk {
		end := off + chunk
		if end > size {
			end = size
		}
		n, err := st.Write(body[off:end])
		atomic.AddInt64(&written, int64(n))
		if err != nil {
			werr = err
			break
		}
	}
	close(done)
	cerr := st.Close()
	ev := map[string]interface{}{"tag": tag, "id": st.StreamID(), "written": atomic.LoadInt64(&written), "sha256": hexsum(body)}
	if werr != nil {
		ev["err"] = "write: " + werr.Error()
	} else if cerr != nil {
		ev["err"] = "close: " + cerr.Error()
	}
	report("write_done", ev)
}

func (p *peer) stats() map[string]interface{} {
	w := map[string]interface{}{}
	p.writers.Range(func(k, v interface{}) bool {
		w[k.(string)] = atomic.LoadInt64(v.(*int64))
		return true
	})
	readErr, eof := p.tap.readEnd()
	return map[string]interface{}{
		"num_streams": p.sess.NumStreams(),
		"closed":      p.sess.IsClosed(),
		"echoed":      atomic.LoadInt64(&p.echoed),
		"opened":      atomic.LoadInt64(&p.opened),
		"writers":     w,
		"frames_in":   p.tap.in.snapshot(),
		"frames_out":  p.tap.out.snapshot(),
		"read_end":    readErr,
		"read_eof":    eof,
	}
}

type command struct {
	Cmd   string `json:"cmd"`
	N     int    `json:"n"`
	Size  int    `json:"size"`
	Chunk int    `json:"chunk"`
	Tag   string `json:"tag"`
}

func (p *peer) commands() {
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		var c command
		if err := json.Unmarshal([]byte(line), &c); err != nil {
			report("error", map[string]interface{}{"msg": "bad command: " + err.Error()})
			continue
		}
		switch c.Cmd {
		case "open":
			if c.N <= 0 {
				c.N = 1
			}
			go p.openMany(c.Tag, c.N, c.Size)
		case "write":
			if c.Chunk <= 0 {
				c.Chunk = 4096
			}
			go p.writeRaw(c.Tag, c.Size, c.Chunk)
		case "goaway":
			go func() { report("goaway_sent", map[string]interface{}{"err": errStr(p.sess.GoAway())}) }()
		case "ping":
			go func() {
				rtt, err := p.sess.Ping()
				if err != nil {
					report("ping_failed", map[string]interface{}{"err": err.Error()})
				} else {
					report("pong", map[string]interface{}{"rtt_ms": float64(rtt.Microseconds()) / 1000})
				}
			}()
		case "stats":
			report("stats", p.stats())
		case "close":
			go func() { report("close_called", map[string]interface{}{"err": errStr(p.sess.Close())}) }()
		default:
			report("error", map[string]interface{}{"msg": "unknown command " + c.Cmd})
		}
	}
}

// ---------------------------------------------------------------- main

func main() {
	role := flag.String("role", "server", "yamux role: client (odd ids) or server (even ids)")
	transport := flag.String("transport", "tcp", "tcp or ws")
	listen := flag.String("listen", "", "listen address (host:port, port 0 = any); reports the bound address")
	dial := flag.String("dial", "", "address to dial (host:port)")
	wsPath := flag.String("ws-path", "/yamux", "WebSocket path (server) or path to request (client)")
	token := flag.String("token", "", "bearer token: required from the peer (WS server) or sent (WS client)")
	echo := flag.Bool("echo", true, "accept streams and echo them")
	openN := flag.Int("open", 0, "open this many streams at session start (see -size)")
	size := flag.Int("size", 1024, "payload size for -open")
	goaway := flag.Bool("goaway", false, "send GoAway(0) right after the session starts")
	keepalive := flag.Duration("keepalive", 0, "keepalive interval (0 = keepalive disabled)")
	writeTimeout := flag.Duration("write-timeout", 10*time.Second, "ConnectionWriteTimeout (also the ping timeout)")
	window := flag.Uint("window", 256*1024, "MaxStreamWindowSize")
	flag.BoolVar(&traceFrames, "trace", false, "report every frame header (event trace)")
	flag.Parse()

	cfg := yamux.DefaultConfig()
	cfg.EnableKeepAlive = *keepalive > 0
	if *keepalive > 0 {
		cfg.KeepAliveInterval = *keepalive
	}
	cfg.ConnectionWriteTimeout = *writeTimeout
	cfg.MaxStreamWindowSize = uint32(*window)
	cfg.LogOutput = logWriter{}
	if err := yamux.VerifyConfig(cfg); err != nil {
		report("error", map[string]interface{}{"msg": "config: " + err.Error()})
		os.Exit(2)
	}
	if (*listen == "") == (*dial == "") {
		report("error", map[string]interface{}{"msg": "exactly one of -listen and -dial is required"})
		os.Exit(2)
	}

	conn, err := connect(*transport, *listen, *dial, *wsPath, *token)
	if err != nil {
		report("error", map[string]interface{}{"msg": "connect: " + err.Error()})
		os.Exit(1)
	}
	tap := &tapConn{inner: conn, in: newParser("in"), out: newParser("out")}
	var sess *yamux.Session
	if *role == "client" {
		sess, err = yamux.Client(tap, cfg)
	} else {
		sess, err = yamux.Server(tap, cfg)
	}
	if err != nil {
		report("error", map[string]interface{}{"msg": "session: " + err.Error()})
		os.Exit(1)
	}
	p := &peer{sess: sess, tap: tap}
	report("session_started", map[string]interface{}{"role": *role, "transport": *transport,
		"keepalive_ms": keepalive.Milliseconds(), "write_timeout_ms": writeTimeout.Milliseconds(), "window": *window})
	if *echo {
		go p.acceptLoop()
	}
	go p.commands()
	if *goaway {
		report("goaway_sent", map[string]interface{}{"err": errStr(sess.GoAway())})
	}
	if *openN > 0 {
		go p.openMany("flag", *openN, *size)
	}
	<-sess.CloseChan()
	time.Sleep(50 * time.Millisecond) // let stream goroutines report
	report("session_closed", p.stats())
	os.Exit(0)
}

func connect(transport, listen, dial, wsPath, token string) (io.ReadWriteCloser, error) {
	switch transport {
	case "tcp":
		if dial != "" {
			c, err := net.Dial("tcp", dial)
			if err != nil {
				return nil, err
			}
			report("connected", map[string]interface{}{"local": c.LocalAddr().String(), "remote": c.RemoteAddr().String()})
			return c, nil
		}
		ln, err := net.Listen("tcp", listen)
		if err != nil {
			return nil, err
		}
		report("listening", map[string]interface{}{"addr": ln.Addr().String()})
		c, err := ln.Accept()
		ln.Close()
		if err != nil {
			return nil, err
		}
		report("connected", map[string]interface{}{"local": c.LocalAddr().String(), "remote": c.RemoteAddr().String()})
		return c, nil
	case "ws":
		if dial != "" {
			h := http.Header{}
			if token != "" {
				h.Set("Authorization", "Bearer "+token)
			}
			c, resp, err := websocket.DefaultDialer.Dial("ws://"+dial+wsPath, h)
			if err != nil {
				if resp != nil {
					return nil, fmt.Errorf("%v (HTTP %d)", err, resp.StatusCode)
				}
				return nil, err
			}
			report("connected", map[string]interface{}{"local": c.LocalAddr().String(), "remote": c.RemoteAddr().String()})
			return &wsConn{c: c}, nil
		}
		ln, err := net.Listen("tcp", listen)
		if err != nil {
			return nil, err
		}
		report("listening", map[string]interface{}{"addr": ln.Addr().String(), "path": wsPath})
		got := make(chan *websocket.Conn, 1)
		up := websocket.Upgrader{}
		mux := http.NewServeMux()
		mux.HandleFunc(wsPath, func(w http.ResponseWriter, r *http.Request) {
			if token != "" && r.Header.Get("Authorization") != "Bearer "+token {
				report("http_rejected", map[string]interface{}{"status": 401, "authorization": r.Header.Get("Authorization")})
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			c, err := up.Upgrade(w, r, nil)
			if err != nil {
				report("error", map[string]interface{}{"msg": "upgrade: " + err.Error()})
				return
			}
			select {
			case got <- c:
			default:
				c.Close() // one session per process
			}
		})
		srv := &http.Server{Handler: mux, ErrorLog: log.New(io.Discard, "", 0)}
		go srv.Serve(ln)
		c := <-got
		ln.Close() // hijacked connections survive this
		report("connected", map[string]interface{}{"local": c.LocalAddr().String(), "remote": c.RemoteAddr().String()})
		return &wsConn{c: c}, nil
	}
	return nil, fmt.Errorf("unknown transport %q", transport)
}
