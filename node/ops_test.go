package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// P.E.status for an engine with many requests pages them so that no reply
// exceeds the server's max_payload: a server with a 32 KiB limit and 1,500
// live requests (about 300 KiB of snapshots) answers in pages, each under
// the limit, that together list every request once. A bad page or body
// gets an error reply (never silence) and is counted.
func TestStatusPagesStayUnderMaxPayload(t *testing.T) {
	t.Parallel()
	const maxPayload = 32 << 10
	s := testkit.NATSServerWith(t, func(o *server.Options) { o.MaxPayload = maxPayload })
	e := startNode(t, func(c *node.Config) { c.NATSURL = s.ClientURL() })

	te := e.newEngine("many", defaultOpts())
	te.register()
	const requests = 1500
	var batch []map[string]any
	for i := range requests {
		batch = append(batch, added(fmt.Sprintf("request-%05d", i), 64))
		if len(batch) == 100 {
			te.send(batch...)
			batch = nil
		}
	}
	seen := map[string]bool{}
	var pages, largest int
	for page := 0; ; page++ {
		msg, err := e.nc.Request("kvactors.many.status", []byte(`{"page":`+strconv.Itoa(page)+`}`), 5*time.Second)
		require.NoError(t, err, "page %d", page)
		require.LessOrEqual(t, len(msg.Data), maxPayload)
		largest = max(largest, len(msg.Data))
		var st node.StatusReply
		require.NoError(t, json.Unmarshal(msg.Data, &st))
		require.Empty(t, st.Error)
		require.Equal(t, requests, st.TotalRequests)
		require.Equal(t, page, st.Page)
		for _, r := range st.Requests {
			require.False(t, seen[r.Request], "request %s on two pages", r.Request)
			seen[r.Request] = true
		}
		pages = st.Pages
		if !st.Truncated {
			require.Equal(t, st.Pages-1, page, "the last page is the one not truncated")
			break
		}
		require.Less(t, page, requests, "paging must end")
	}
	require.Len(t, seen, requests)
	require.Greater(t, pages, 2, "300 KiB of snapshots cannot fit one 16 KiB page")
	t.Logf("%d requests in %d pages, largest reply %d bytes (max_payload %d)", requests, pages, largest, maxPayload)

	for body, want := range map[string]string{
		`{"page":` + strconv.Itoa(pages) + `}`: "pages",
		`{"page":-1}`:                          "page -1",
		`not json`:                             "status body",
	} {
		msg, err := e.nc.Request("kvactors.many.status", []byte(body), 5*time.Second)
		require.NoError(t, err, "%s: an error reply, not silence", body)
		var st node.StatusReply
		require.NoError(t, json.Unmarshal(msg.Data, &st))
		require.Contains(t, st.Error, want, body)
	}
	metrics := scrape(t, e)
	require.Contains(t, metrics, `kvactors_events_rejected_total{reason="malformed"} 1`)
	require.Contains(t, metrics, `kvactors_events_rejected_total{reason="out_of_range"} 2`, "a negative page and one past the last")
}

// A fresh node's /metrics has every labelled counter at 0 for every known
// label value (alerts on rate() see 0, not "no data") and the build info.
func TestFreshNodeExportsEveryKnownLabel(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	body := scrape(t, e)
	for _, want := range []string{
		`kvactors_events_rejected_total{reason="hole"} 0`,
		`kvactors_events_rejected_total{reason="unknown_engine"} 0`,
		`kvactors_events_rejected_total{reason="malformed"} 0`,
		`kvactors_store_deferrals_total{reason="tokens"} 0`,
		`kvactors_store_deferrals_total{reason="hashes"} 0`,
		`kvactors_store_deferrals_total{reason="blocks"} 0`,
		`kvactors_store_retries_total{reason="pool_full"} 0`,
		`kvactors_store_retries_total{reason="copy_failed"} 0`,
		`kvactors_requests_released_total{reason="finished"} 0`,
		`kvactors_requests_released_total{reason="engine_reset"} 0`,
		`kv_offload_total_bytes{transfer_type="GPU_to_CPU"} 0`,
		`kv_offload_total_bytes{transfer_type="CPU_to_GPU"} 0`,
		`kv_offload_total_time{transfer_type="CPU_to_GPU"} 0`,
		`kvactors_transfer_failures_total{transfer_type="GPU_to_CPU"} 0`,
		`kvactors_transfer_copy_size_bytes_count{transfer_type="CPU_to_GPU"} 0`,
		`kvactors_load_requests_total{result="ok"} 0`,
		`kvactors_load_requests_total{result="error"} 0`,
		`kvactors_load_waits_total{outcome="loaded"} 0`,
		`kvactors_load_waits_total{outcome="timed_out"} 0`,
		`kvactors_load_waits_total{outcome="too_many"} 0`,
		`kvactors_load_retries_total 0`,
		`kvactors_actor_unexpected_messages_total{actor="request"} 0`,
		`kvactors_actor_unexpected_messages_total{actor="transfer"} 0`,
	} {
		require.Contains(t, body, want)
	}
	require.Regexp(t, `kvactors_build_info\{goversion="go[^"]+",revision="[^"]+",version="[^"]+"\} 1`, body)
}

// /debug/pprof is served only with Pprof (--pprof).
func TestPprofOnlyWhenAsked(t *testing.T) {
	t.Parallel()
	for _, on := range []bool{false, true} {
		e := startNode(t, func(c *node.Config) { c.Pprof = on })
		resp, err := http.Get("http://" + e.node.HTTPAddr() + "/debug/pprof/")
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		want := http.StatusNotFound
		if on {
			want = http.StatusOK
		}
		require.Equal(t, want, resp.StatusCode, "pprof %v", on)
	}
}

// With --nats and the server not up yet, Start retries with backoff and
// succeeds once the server comes (a node booted before its NATS cluster).
func TestStartWaitsForNATS(t *testing.T) { // not parallel: binds a port it freed
	port := freePort(t)
	retrying := make(chan struct{}, 1)
	log := slog.New(slog.NewTextHandler(signalWriter{on: "retrying", ch: retrying}, nil))
	type result struct {
		n   *node.Node
		err error
	}
	done := make(chan result, 1)
	go func() {
		n, err := node.Start(context.Background(), node.Config{NATSURL: "nats://127.0.0.1:" + strconv.Itoa(port),
			NATSConnectTimeout: 30 * time.Second, ShmDir: t.TempDir(), PoolBytes: 1 << 20, HTTPAddr: "off",
			Registry: prometheus.NewRegistry(), Log: log})
		done <- result{n, err}
	}()
	select {
	case <-retrying:
	case r := <-done:
		t.Fatalf("Start returned before the server was up: %v", r.err)
	case <-time.After(10 * time.Second):
		t.Fatal("Start did not log a retry")
	}
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true})
	require.NoError(t, err)
	s.Start()
	t.Cleanup(s.Shutdown)
	require.True(t, s.ReadyForConnections(10*time.Second))
	select {
	case r := <-done:
		require.NoError(t, r.err)
		t.Cleanup(func() { _ = r.n.Close(context.Background()) })
		require.NoError(t, r.n.Ready())
	case <-time.After(15 * time.Second):
		t.Fatal("Start did not connect once the server was up")
	}
}

// The retries are bounded by NATSConnectTimeout, and end at once when the
// context is cancelled (SIGTERM while waiting).
func TestStartGivesUpOnNATS(t *testing.T) {
	t.Parallel()
	// A port held for the test, every connection closed at once: a NATS
	// URL no server answers on. (A port freed for the purpose was taken
	// meanwhile by another package's NATS server once, and the node
	// connected to it.)
	nowhere := testkit.NewLink(t, "127.0.0.1:1")
	nowhere.Cut()
	cfg := node.Config{NATSURL: "nats://" + nowhere.Addr, ShmDir: t.TempDir(),
		PoolBytes: 1 << 20, HTTPAddr: "off", Log: slog.New(slog.DiscardHandler)}
	cfg.NATSConnectTimeout = 300 * time.Millisecond
	start := time.Now()
	_, err := node.Start(context.Background(), cfg)
	require.ErrorContains(t, err, "attempts in 300ms")
	require.Less(t, time.Since(start), 5*time.Second)

	cfg.NATSConnectTimeout = time.Hour
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = node.Start(ctx, cfg)
	require.ErrorIs(t, err, context.Canceled)
}

// A taken embedded NATS port is "address already in use" with the way out,
// at once (the server runs silent, and used to time out after 10 s); so is
// a taken admin port.
func TestEmbeddedNATSPortInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	start := time.Now()
	_, err = node.Start(context.Background(), node.Config{NATSPort: ln.Addr().(*net.TCPAddr).Port,
		ShmDir: t.TempDir(), PoolBytes: 1 << 20, HTTPAddr: "off", Log: slog.New(slog.DiscardHandler)})
	require.ErrorContains(t, err, "address already in use")
	require.ErrorContains(t, err, "--nats-port")
	require.Less(t, time.Since(start), 5*time.Second)

	// The admin port too.
	_, err = node.Start(context.Background(), node.Config{NATSPort: -1, ShmDir: t.TempDir(), PoolBytes: 1 << 20,
		HTTPAddr: ln.Addr().String(), Log: slog.New(slog.DiscardHandler)})
	require.ErrorContains(t, err, "address already in use")
	require.ErrorContains(t, err, "--http")
}

func scrape(t *testing.T, e *env) string {
	t.Helper()
	resp, err := http.Get("http://" + e.node.HTTPAddr() + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(body)
}

// signalWriter signals ch (without blocking) when a write contains on.
type signalWriter struct {
	on string
	ch chan struct{}
}

func (w signalWriter) Write(p []byte) (int, error) {
	if strings.Contains(string(p), w.on) {
		select {
		case w.ch <- struct{}{}:
		default:
		}
	}
	return len(p), nil
}
