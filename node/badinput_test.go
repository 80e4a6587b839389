package node_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// metricValue sums the samples of a metric whose labels include want.
func metricValue(t *testing.T, reg prometheus.Gatherer, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if have[k] != v {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.Counter.GetValue()
			case m.Gauge != nil:
				sum += m.Gauge.GetValue()
			case m.Histogram != nil:
				sum += float64(m.Histogram.GetSampleCount())
			}
		}
	}
	return sum
}

func rejected(t *testing.T, e *env, reason string) float64 {
	return metricValue(t, e.reg, "kvactors_events_rejected_total", map[string]string{"reason": reason})
}

// Bad input gets a clear error, is counted, and changes nothing else: a valid
// engine keeps storing in the same run (issue 3, "Bad input").
func TestBadInputIsRejectedCountedAndHarmless(t *testing.T) {
	t.Parallel()
	e := startNode(t, silenceNotTested)
	te := e.newEngine("good", defaultOpts())
	te.register()
	te.send(added("r", 8), hashesEv("r", 0, hash("g", 0), hash("g", 1)), blocksEv("r", 0, 0, 1))

	cases := []struct {
		name   string
		send   func()
		reason string
	}{
		{"malformed JSON", func() { te.sendRaw([]byte(`{"epoch":"ep1","seq":`)) }, "malformed"},
		{"wrong type", func() { te.send(map[string]any{"type": "tokens", "request": "r", "computed": "ten", "total": 8}) }, "wrong_type"},
		{"unknown event type", func() { te.send(map[string]any{"type": "exploded", "request": "r"}) }, "unknown_type"},
		{"request id too long", func() { te.send(added(strings.Repeat("x", 300), 4)) }, "bad_request_id"},
		{"unknown request", func() { te.send(tokensEv("nobody", 4, 4)) }, "unknown_request"},
		{"hashes hole", func() { te.send(hashesEv("r", 5, hash("g", 5))) }, "hole"},
		{"hashes conflict", func() { te.send(hashesEv("r", 0, hash("zz", 0))) }, "conflict"},
		{"blocks hole", func() { te.send(blocksEv("r", 0, 4, 9)) }, "hole"},
		{"blocks conflict", func() { te.send(blocksEv("r", 0, 0, 2)) }, "conflict"},
		{"block id out of range", func() { te.send(blocksEv("r", 0, 1, 1000)) }, "block_range"},
		{"group out of range", func() { te.send(blocksEv("r", 3, 0, 1)) }, "bad_group"},
		{"added twice with another prompt", func() { te.send(added("r", 9)) }, "prompt_mismatch"},
		{"unknown engine", func() {
			require.NoError(t, e.nc.Publish("kvactors.nobody.events", []byte(`{"epoch":"x","seq":1,"events":[]}`)))
		}, "unknown_engine"},
		{"huge array", func() {
			ids := make([]int, 1<<20+1)
			te.send(blocksEv("r", 0, 1, ids...))
		}, "too_large"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := rejected(t, e, c.reason)
			c.send()
			testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
				if got := rejected(t, e, c.reason); got != before+1 {
					return fmt.Errorf("rejected{reason=%q} = %v, want %v", c.reason, got, before+1)
				}
				return nil
			})
		})
	}
	// Nothing above changed the request: one hash-complete chunk with a block,
	// no tokens yet; completing it stores chunk 0 with the engine's bytes.
	st := te.sync()
	require.Len(t, st.Requests, 1)
	require.Equal(t, 2, st.Requests[0].Hashes)
	require.Equal(t, 1, st.Requests[0].Groups[0].Blocks)
	te.fill(0, 1, 3)
	te.send(tokensEv("r", 8, 8))
	require.Equal(t, []int{0}, chunkIndexes(recv(t, te.stored, "stored after bad input")))
}

// Hostile segments are refused at register with an error naming the
// problem; the node keeps serving (issue 3, "hostile shm names").
func TestHostileSegmentsAreRefused(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	outside := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(outside, make([]byte, 1<<20), 0o600))
	require.NoError(t, os.Symlink(outside, filepath.Join(e.dir, "h-link")))
	te := e.newEngine("h", defaultOpts())
	cases := []struct {
		name    string
		mutate  func(s *messages.EngineSpec)
		wantErr string
	}{
		{"path traversal", func(s *messages.EngineSpec) { s.Segments[0].Shm = "../etc/passwd" }, "not a plain file name"},
		{"symlink", func(s *messages.EngineSpec) { s.Segments[0].Shm = "h-link" }, "symlink"},
		{"missing", func(s *messages.EngineSpec) { s.Segments[0].Shm = "h-nope" }, "does not exist"},
		{"not named after the engine", func(s *messages.EngineSpec) { s.Segments[0].Shm = "link" }, `is not engine "h"'s`},
		{"region past the end", func(s *messages.EngineSpec) { s.Groups[0].Regions[0].Offset = 1 << 20 }, "past segment"},
		{"tokens_per_chunk not a multiple of tph", func(s *messages.EngineSpec) { s.TokensPerHash = 3 }, "multiple"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			spec := te.spec
			spec.Segments = append([]messages.Segment(nil), te.spec.Segments...)
			spec.Groups = append([]messages.GroupSpec(nil), te.spec.Groups...)
			spec.Groups[0].Regions = append([]messages.Region(nil), te.spec.Groups[0].Regions...)
			c.mutate(&spec)
			before := rejected(t, e, "bad_spec")
			var reply messages.RegisterReply
			require.NoError(t, jsonUnmarshal(te.request("register", spec), &reply))
			require.False(t, reply.OK)
			require.Contains(t, reply.Error, c.wantErr)
			require.Equal(t, before+1, rejected(t, e, "bad_spec"))
		})
	}
	te.register() // the honest spec still works
	te.send(added("r", 4), hashesEv("r", 0, hash("h", 0)), blocksEv("r", 0, 0, 1), tokensEv("r", 4, 4))
	recv(t, te.stored, "stored")
}

// /metrics, /healthz, /readyz and /debug/engines answer; counters moved by
// the amounts a scenario implies (issue 4).
func TestAdminEndpointsAndCounters(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("m", defaultOpts())
	te.register()
	hs := []string{hash("m", 0), hash("m", 1)}
	te.send(added("r", 8), blocksEv("r", 0, 0, 1, 2), tokensEv("r", 8, 8))
	te.send(hashesEv("r", 0, hs[0]))
	recv(t, te.stored, "chunk 0")
	te.send(hashesEv("r", 1, hs[1]))
	recv(t, te.stored, "chunk 1")
	te.send(finishedEv("r", false, 8, 8))
	recv(t, te.released, "released")

	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + e.node.HTTPAddr() + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(body)
	}
	code, _ := get("/healthz")
	require.Equal(t, 200, code)
	code, body := get("/readyz")
	require.Equal(t, 200, code, body)
	code, body = get("/debug/engines")
	require.Equal(t, 200, code)
	require.Contains(t, body, `"engine": "m"`)
	code, body = get("/metrics")
	require.Equal(t, 200, code)
	require.Contains(t, body, "kvactors_store_chunks_stored_total 2")
	require.Contains(t, body, `kv_offload_total_bytes{transfer_type="GPU_to_CPU"} 512`)
	require.Contains(t, body, `kvactors_store_deferrals_total{reason="hashes"} 2`)
	require.Contains(t, body, `kvactors_requests_released_total{reason="finished"} 1`)
	require.Contains(t, body, `kvactors_pool_chunks{state="ready"} 2`)
}

// A node that cannot start returns an error and leaves nothing behind
// (it used to panic tearing down a nil node).
func TestStartFailureIsAnError(t *testing.T) {
	_, err := node.Start(context.Background(), node.Config{NATSURL: "nats://127.0.0.1:1", HTTPAddr: "off",
		ShmDir: t.TempDir(), PoolBytes: 1 << 20, NATSConnectTimeout: 50 * time.Millisecond,
		Log: slog.New(slog.DiscardHandler)})
	require.ErrorContains(t, err, "connect to nats")
	_, err = node.Start(context.Background(), node.Config{Backend: "tape"})
	require.ErrorIs(t, err, node.ErrConfig)
}

// A load refused for its input is counted in
// kvactors_events_rejected_total{reason} as a lookup is: a body that does not
// decode or does not fit the layout, a block id past num_gpu_blocks, an
// unknown engine. Answered with the error, nothing else changes; its log
// line names the reason it is counted under, as every rejection's does
// (docs/PROTOCOL.md "Rejections"), so the log is searched by the metric's
// label.
func TestBadLoadsAreCountedByReason(t *testing.T) {
	t.Parallel()
	var logs testkit.SyncBuffer
	e := startNode(t, func(c *node.Config) { c.Log = slog.New(slog.NewTextHandler(&logs, nil)) })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	hs := []string{hash("a", 0)}
	for _, tc := range []struct {
		name, engine, body, reason string
	}{
		{"not json", "e1", `{"request":`, messages.RejectMalformed},
		{"bad hash", "e1", `{"request":"l","hashes":["XY"],"num_tokens":4,"blocks":[[1]]}`, messages.RejectBadHash},
		{"too few block ids", "e1", `{"request":"l","hashes":["` + hs[0] + `"],"num_tokens":4,"blocks":[[]]}`,
			messages.RejectMalformed},
		{"block id past num_gpu_blocks", "e1", `{"request":"l","hashes":["` + hs[0] + `"],"num_tokens":4,"blocks":[[64]]}`,
			messages.RejectBlockRange},
		{"unknown engine", "nobody", `{"request":"l","hashes":[],"num_tokens":0,"blocks":[[]]}`,
			messages.RejectUnknownEngine},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := rejected(t, e, tc.reason)
			msg, err := testkit.EngineRequest(e.nc, tc.engine, "kvactors."+tc.engine+".load", []byte(tc.body), 5*time.Second)
			require.NoError(t, err)
			var r messages.LoadReply
			require.NoError(t, jsonUnmarshal(msg.Data, &r))
			require.False(t, r.OK)
			require.NotEmpty(t, r.Error)
			require.Equal(t, before+1, rejected(t, e, tc.reason), "counted as %s: %s", tc.reason, r.Error)
			// The node logs before it replies: the line is written by now.
			text := logs.String()
			i := strings.LastIndex(text, `msg="load refused"`)
			require.GreaterOrEqual(t, i, 0, "logged")
			line, _, _ := strings.Cut(text[i:], "\n")
			require.Contains(t, line, " reason="+tc.reason, "the log line's reason")
		})
	}
	require.Equal(t, 0, te.lookup(hs), "nothing stored, nothing changed")
}

// After a node's start, every engine's first heartbeat is one of an engine
// it does not know: the node answers unknown engine and the engine
// registers again, the normal recovery path (PROTOCOL.md), logged at Info
// during the node's first lease. Past it, an engine that beats
// unregistered is misbehaving: logged at Error. Both are counted
// unknown_engine.
func TestUnregisteredHeartbeatIsInfoDuringTheFirstLease(t *testing.T) {
	t.Parallel()
	unregisteredIsInfoDuringTheFirstLease(t, "kvactors.ghost.heartbeat", `{"epoch":"ep1","seq":1}`,
		"heartbeat of an unregistered engine")
}

// The batches an engine sent before its first heartbeat after the node's
// restart told it so are of an engine the node does not know either: the
// same recovery path, logged the same (Info in the first lease, Error
// after), counted unknown_engine alike.
func TestUnregisteredEventsAreInfoDuringTheFirstLease(t *testing.T) {
	t.Parallel()
	unregisteredIsInfoDuringTheFirstLease(t, "kvactors.ghost.events", `{"epoch":"ep1","seq":1,"events":[]}`,
		"events for an unregistered engine")
}

// A lookup, a load or an unregister the engine sent before it learned of
// the node's restart is the same recovery path: Info in the first lease,
// Error after, counted unknown_engine alike.
func TestUnregisteredLookupsLoadsAndUnregistersAreInfoDuringTheFirstLease(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ verb, data, line string }{
		{"lookup", `{"hashes":[]}`, "lookup of an unregistered engine"},
		{"load", `{"request":"r1","chunks":[]}`, "load refused"},
		{"unregister", `{}`, "unregister of an unknown engine"},
	} {
		t.Run(tc.verb, func(t *testing.T) {
			t.Parallel()
			unregisteredIsInfoDuringTheFirstLease(t, "kvactors.ghost."+tc.verb, tc.data, tc.line)
		})
	}
}

// unregisteredIsInfoDuringTheFirstLease sends data on subject as the
// unregistered engine ghost, once within the node's first lease and once
// past it, and checks each is answered unknown engine, counted, and logged
// as line at Info, then at Error.
func unregisteredIsInfoDuringTheFirstLease(t *testing.T, subject, data, line string) {
	t.Helper()
	const lease = 10 * time.Second
	var logs testkit.SyncBuffer
	var offset atomic.Int64 // the node's clock runs ahead of the wall clock by this
	e := startNode(t, func(c *node.Config) { c.Lease, c.Log = lease, slog.New(slog.NewTextHandler(&logs, nil)) },
		node.WithClock(func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }))
	send := func() string {
		t.Helper()
		before := rejected(t, e, messages.RejectUnknownEngine)
		msg, err := testkit.EngineRequest(e.nc, "ghost", subject, []byte(data), 5*time.Second)
		require.NoError(t, err)
		require.Contains(t, string(msg.Data), "unknown engine")
		require.Equal(t, before+1, rejected(t, e, messages.RejectUnknownEngine))
		var last string
		for l := range strings.Lines(logs.String()) {
			if strings.Contains(l, line) {
				last = l
			}
		}
		require.NotEmpty(t, last, "no line logged")
		return last
	}
	require.Contains(t, send(), "level=INFO", "within the first lease")
	offset.Store(int64(lease))
	require.Contains(t, send(), "level=ERROR", "past the first lease")
}
