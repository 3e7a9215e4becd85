// gotransport: the Go side of benchmarks/bench_transport.py. It runs one of the
// benchmark's two roles over hashicorp/yamux carried in gorilla/websocket binary
// messages, so the Python yamux/WS transport can be measured against Go's in the
// same run, and either side can be paired with the other (mixed pairs).
//
// Build (offline, GOPATH mode, Debian's golang-github-hashicorp-yamux-dev and
// golang-github-gorilla-websocket-dev; bench_transport.py does this and caches
// the binary under benchmarks/gotransport/bin/):
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o gotransport main.go
//
// The command protocol is bench_transport.py's: every stream opens with one op
// byte and a 64-bit big-endian count. 'U': the dialler sends n bytes and the
// listener answers 'K' once it has them all; 'D': the listener sends n bytes;
// 'E': the listener echoes every byte.
//
// -role server (the frontend): listens on 127.0.0.1, requires the bearer token
// at the upgrade, prints {"port","pid","rss_ready_kib"} on stdout, serves one
// session and exits when stdin closes, printing its counters as one JSON line.
// -role client (the worker): dials, runs the tests named by -tests and prints
// one JSON line of rows in the shape bench_transport.py's Python client prints.
//
// Settings: yamux's DefaultConfig except MaxStreamWindowSize (256 KiB, the
// Python default, also Go's initial window); gorilla's default 4 KiB read and
// write buffers unless -ws-buffer says otherwise. One yamux Write of the
// carrier is one WebSocket message, so a data frame goes as two messages (the
// 12-byte header, then the body): what this yamux version does on any conn.
// This program must never be given a byte count it cannot bound: the server
// refuses counts above -max-bytes.
package main

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/ioutil"
	"log"
	"net"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gorilla/websocket"
	"github.com/hashicorp/yamux"
)

const (
	chunk     = 64 * 1024
	opUpload  = 'U'
	opDown    = 'D'
	opEcho    = 'E'
	ack       = 'K'
	cmdLength = 9
)

var payload = func() []byte {
	b := make([]byte, chunk)
	for i := range b {
		b[i] = byte(i*7 + 3)
	}
	return b
}()

// ------------------------------------------------------------ process figures

func cpuSelf() float64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

func peakRSSKiB() int64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Maxrss // KiB on Linux
}

// rssKiB is the resident set of pid (0: this process) from /proc/PID/statm.
func rssKiB(pid int) int64 {
	path := "/proc/self/statm"
	if pid > 0 {
		path = fmt.Sprintf("/proc/%d/statm", pid)
	}
	b, err := ioutil.ReadFile(path)
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0
	}
	pages, _ := strconv.ParseInt(f[1], 10, 64)
	return pages * int64(os.Getpagesize()) / 1024
}

// cpuOf is the user + system CPU seconds of another process (/proc/PID/stat;
// clock ticks are 100 per second on Linux).
func cpuOf(pid int) float64 {
	b, err := ioutil.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	// the command name may hold spaces: fields start after the last ')'
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / 100
}

func emit(v interface{}) {
	b, _ := json.Marshal(v)
	os.Stdout.Write(append(b, '\n'))
}

func fail(format string, a ...interface{}) {
	fmt.Fprintf(os.Stderr, "gotransport: "+format+"\n", a...)
	os.Exit(1)
}

// ------------------------------------------------------------ the carrier

// wsConn carries the yamux byte stream in binary WebSocket messages; message
// boundaries mean nothing. gorilla allows one reader and one writer at a time:
// yamux reads from one goroutine and writes from one (its send loop).
type wsConn struct {
	c *websocket.Conn
	r io.Reader
}

func (w *wsConn) Read(p []byte) (int, error) {
	for {
		if w.r == nil {
			mt, r, err := w.c.NextReader()
			if err != nil {
				var ce *websocket.CloseError
				if errors.As(err, &ce) {
					return 0, io.EOF
				}
				return 0, err
			}
			if mt != websocket.BinaryMessage {
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
	if err := w.c.WriteMessage(websocket.BinaryMessage, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (w *wsConn) Close() error {
	w.c.WriteControl(websocket.CloseMessage,
		websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""),
		time.Now().Add(time.Second))
	return w.c.Close()
}

func yamuxConfig(windowKiB int) *yamux.Config {
	cfg := yamux.DefaultConfig()
	cfg.MaxStreamWindowSize = uint32(windowKiB * 1024)
	cfg.LogOutput = ioutil.Discard
	if err := yamux.VerifyConfig(cfg); err != nil {
		fail("yamux config: %v", err)
	}
	return cfg
}

// ------------------------------------------------------------ the listening side

type serverStats struct {
	received, sent int64
	streams        int64
	refused        int64
}

func serve(st *yamux.Stream, stats *serverStats, maxBytes uint64) {
	defer st.Close()
	atomic.AddInt64(&stats.streams, 1)
	var head [cmdLength]byte
	if _, err := io.ReadFull(st, head[:]); err != nil {
		return
	}
	n := binary.BigEndian.Uint64(head[1:])
	switch head[0] {
	case opUpload:
		if n > maxBytes {
			atomic.AddInt64(&stats.refused, 1)
			return
		}
		got, err := io.CopyN(ioutil.Discard, st, int64(n))
		atomic.AddInt64(&stats.received, got)
		if err != nil {
			return
		}
		st.Write([]byte{ack})
	case opDown:
		if n > maxBytes {
			atomic.AddInt64(&stats.refused, 1)
			return
		}
		for left := n; left > 0; {
			m := uint64(chunk)
			if left < m {
				m = left
			}
			w, err := st.Write(payload[:m])
			atomic.AddInt64(&stats.sent, int64(w))
			if err != nil {
				return
			}
			left -= m
		}
	case opEcho:
		buf := make([]byte, chunk)
		for {
			r, err := st.Read(buf)
			if r > 0 {
				atomic.AddInt64(&stats.received, int64(r))
				w, werr := st.Write(buf[:r])
				atomic.AddInt64(&stats.sent, int64(w))
				if werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	default:
		atomic.AddInt64(&stats.refused, 1)
		return
	}
	// Wait for the dialler to end the stream; this yamux cannot read after its
	// own Close, and closing first would cut bytes still in flight.
	io.Copy(ioutil.Discard, st)
}

func runServer(path, token string, windowKiB, wsBuffer int, maxBytes uint64) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail("listen: %v", err)
	}
	stats := &serverStats{}
	var sessions sync.WaitGroup
	up := websocket.Upgrader{ReadBufferSize: wsBuffer, WriteBufferSize: wsBuffer}
	mux := http.NewServeMux()
	mux.HandleFunc("/"+path, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+token {
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		c, err := up.Upgrade(w, r, nil)
		if err != nil {
			return
		}
		sess, err := yamux.Server(&wsConn{c: c}, yamuxConfig(windowKiB))
		if err != nil {
			c.Close()
			return
		}
		sessions.Add(1)
		go func() {
			defer sessions.Done()
			for {
				st, err := sess.AcceptStream()
				if err != nil {
					return
				}
				go serve(st, stats, maxBytes)
			}
		}()
	})
	srv := &http.Server{Handler: mux, ErrorLog: log.New(ioutil.Discard, "", 0)}
	go srv.Serve(ln)
	emit(map[string]interface{}{"port": ln.Addr().(*net.TCPAddr).Port, "pid": os.Getpid(),
		"rss_ready_kib": rssKiB(0)})
	io.Copy(ioutil.Discard, os.Stdin) // the coordinator closing stdin (or dying) stops us
	ln.Close()
	emit(map[string]interface{}{"server_pauses": 0, "peak_rss_kib": peakRSSKiB(),
		"bytes_received": atomic.LoadInt64(&stats.received),
		"bytes_sent":     atomic.LoadInt64(&stats.sent),
		"streams":        atomic.LoadInt64(&stats.streams),
		"refused":        atomic.LoadInt64(&stats.refused)})
}

// ------------------------------------------------------------ the dialling side

func command(op byte, n uint64) []byte {
	b := make([]byte, cmdLength)
	b[0] = op
	binary.BigEndian.PutUint64(b[1:], n)
	return b
}

func upload(st *yamux.Stream, n uint64) error {
	if _, err := st.Write(command(opUpload, n)); err != nil {
		return err
	}
	for left := n; left > 0; {
		m := uint64(chunk)
		if left < m {
			m = left
		}
		if _, err := st.Write(payload[:m]); err != nil {
			return err
		}
		left -= m
	}
	var b [1]byte
	if _, err := io.ReadFull(st, b[:]); err != nil {
		return fmt.Errorf("waiting for ACK: %v", err)
	}
	if b[0] != ack {
		return fmt.Errorf("expected ACK, got %q", b[0])
	}
	return nil
}

func download(st *yamux.Stream, n uint64) error {
	if _, err := st.Write(command(opDown, n)); err != nil {
		return err
	}
	got, err := io.CopyN(ioutil.Discard, st, int64(n))
	if err != nil {
		return fmt.Errorf("download: %d of %d bytes: %v", got, n, err)
	}
	return nil
}

func percentile(sorted []float64, p float64) float64 {
	k := int(p/100*float64(len(sorted)-1) + 0.5)
	if k < 0 {
		k = 0
	}
	if k > len(sorted)-1 {
		k = len(sorted) - 1
	}
	return sorted[k]
}

type client struct {
	sess      *yamux.Session
	serverPid int
}

// measure opens the streams, then times run alone; the CPU of both processes alongside.
func (c *client) measure(name string, streams int, run func(i int, st *yamux.Stream) error) (map[string]interface{}, float64) {
	fmt.Fprintf(os.Stderr, "#   Go yamux/WS dialler: %s\n", name)
	opened := make([]*yamux.Stream, streams)
	for i := range opened {
		st, err := c.sess.OpenStream()
		if err != nil {
			fail("%s: open: %v", name, err)
		}
		opened[i] = st
	}
	cpuServer, cpuClient := cpuOf(c.serverPid), cpuSelf()
	started := time.Now()
	errs := make(chan error, streams)
	for i, st := range opened {
		go func(i int, st *yamux.Stream) { errs <- run(i, st) }(i, st)
	}
	for range opened {
		if err := <-errs; err != nil {
			fail("%s: %v", name, err)
		}
	}
	elapsed := time.Since(started).Seconds()
	row := map[string]interface{}{"test": name, "seconds": elapsed,
		"cpu_client":     (cpuSelf() - cpuClient) / elapsed,
		"cpu_server":     (cpuOf(c.serverPid) - cpuServer) / elapsed,
		"rss_client_kib": rssKiB(0), "rss_server_kib": rssKiB(c.serverPid)}
	for _, st := range opened {
		st.Close()
	}
	return row, elapsed
}

func runClient(port, serverPid int, path, token string, windowKiB, wsBuffer int, mib, rounds, warmup int, tests string) {
	dialer := websocket.Dialer{ReadBufferSize: wsBuffer, WriteBufferSize: wsBuffer,
		HandshakeTimeout: 10 * time.Second}
	h := http.Header{}
	h.Set("Authorization", "Bearer "+token)
	conn, resp, err := dialer.Dial(fmt.Sprintf("ws://127.0.0.1:%d/%s", port, path), h)
	if err != nil {
		if resp != nil {
			fail("dial: %v (HTTP %d)", err, resp.StatusCode)
		}
		fail("dial: %v", err)
	}
	carrier := &wsConn{c: conn}
	sess, err := yamux.Client(carrier, yamuxConfig(windowKiB))
	if err != nil {
		fail("session: %v", err)
	}
	c := &client{sess: sess, serverPid: serverPid}
	wanted := map[string]bool{}
	for _, t := range strings.Split(tests, ",") {
		wanted[t] = true
	}
	total := uint64(mib) * 1024 * 1024
	out := map[string]interface{}{"rss_ready_kib": rssKiB(0)}
	rows := []map[string]interface{}{}
	for _, direction := range []string{"up", "down"} {
		for _, streams := range []int{1, 8} {
			name := fmt.Sprintf("%s-%d", direction, streams)
			if !wanted[name] {
				continue
			}
			each := total / uint64(streams)
			row, elapsed := c.measure(name, streams, func(i int, st *yamux.Stream) error {
				if direction == "up" {
					return upload(st, each)
				}
				return download(st, each)
			})
			moved := each * uint64(streams)
			row["mb_per_s"] = float64(moved) / elapsed / 1e6
			row["bytes"] = moved
			if direction == "up" {
				row["sender_pauses"] = 0 // Go's writers block instead of pausing
			}
			rows = append(rows, row)
		}
	}
	if wanted["rtt"] {
		var samples []float64
		row, _ := c.measure("rtt", 1, func(i int, st *yamux.Stream) error {
			if _, err := st.Write(command(opEcho, 0)); err != nil {
				return err
			}
			one, back := []byte("x"), make([]byte, 1)
			for r := 0; r < rounds; r++ {
				t0 := time.Now()
				if _, err := st.Write(one); err != nil {
					return err
				}
				if _, err := io.ReadFull(st, back); err != nil {
					return err
				}
				samples = append(samples, time.Since(t0).Seconds())
			}
			return nil
		})
		kept := append([]float64(nil), samples[warmup:]...)
		sort.Float64s(kept)
		row["rtt_p50_us"] = percentile(kept, 50) * 1e6
		row["rtt_p99_us"] = percentile(kept, 99) * 1e6
		row["rounds"] = len(kept)
		row["rounds_total"] = len(samples)
		rows = append(rows, row)
	}
	sess.Close()
	carrier.Close()
	out["tests"] = rows
	out["peak_rss_kib"] = peakRSSKiB()
	emit(out)
}

func main() {
	role := flag.String("role", "", "server (listens: the frontend) or client (dials: the worker)")
	path := flag.String("path", "tunnel", "WebSocket path, without the leading slash")
	token := flag.String("token", "", "bearer token required at (server) or sent with (client) the upgrade")
	window := flag.Int("window", 256, "yamux MaxStreamWindowSize, KiB (at least 256)")
	wsBuffer := flag.Int("ws-buffer", 0, "gorilla read/write buffer size, bytes (0: gorilla's 4096)")
	maxBytes := flag.Uint64("max-bytes", 1<<40, "server: largest byte count a command may ask for")
	port := flag.Int("port", 0, "client: the listener's port on 127.0.0.1")
	serverPid := flag.Int("server-pid", 0, "client: the listener's pid (for its CPU and RSS)")
	mib := flag.Int("mib", 256, "client: MiB moved per bulk test")
	rounds := flag.Int("rounds", 2000, "client: 1-byte echoes")
	warmup := flag.Int("warmup", 200, "client: echoes dropped first")
	tests := flag.String("tests", "up-1,up-8,down-1,down-8,rtt", "client: tests to run")
	flag.Parse()
	if *token == "" {
		fail("-token is required")
	}
	switch *role {
	case "server":
		runServer(*path, *token, *window, *wsBuffer, *maxBytes)
	case "client":
		if *port <= 0 || *port > 65535 || *serverPid <= 0 || *mib <= 0 || *rounds <= *warmup || *warmup < 0 {
			fail("client needs -port, -server-pid, -mib > 0 and -rounds > -warmup >= 0")
		}
		runClient(*port, *serverPid, *path, *token, *window, *wsBuffer, *mib, *rounds, *warmup, *tests)
	default:
		fail("-role must be server or client")
	}
}
