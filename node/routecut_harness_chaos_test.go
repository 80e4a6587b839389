//go:build chaos

package node_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// cutLease is the shortest lease a cluster allows (the bucket's expiry
// markers need 1 s): every wait below is a few of them.
const cutLease = time.Second

// routeCut is nodes on a 3-server NATS cluster whose routes run through
// links (testkit.NATSClusterWithRouteLinks), the ownership bucket made
// before any node starts so that the test knows its stream leader.
type routeCut struct {
	t      *testing.T
	rc     *testkit.RoutedCluster
	kc     *kvCluster
	leader int // the server leading the claims' stream
}

func newRouteCut(t *testing.T) *routeCut {
	t.Helper()
	rc := testkit.NATSClusterWithRouteLinks(t, 3)
	js, err := jetstream.New(rc.Connect(0))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	testkit.Eventually(t, 10*time.Second, 50*time.Millisecond, func() error { // a meta leader may be missing at first
		_, err := cluster.OpenOwners(ctx, js, cluster.Config{Node: "setup", Boot: "setup-boot", Lease: cutLease, Replicas: 3}, nil)
		return err
	})
	r := &routeCut{t: t, rc: rc, kc: &kvCluster{t: t, nats: rc.Cluster, dir: t.TempDir()}, leader: -1}
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		for i := range 3 {
			if rc.Server(i).JetStreamIsStreamLeader("$G", "KV_kvactors_owners") {
				r.leader = i
				return nil
			}
		}
		return errors.New("the claims' stream has no leader")
	})
	return r
}

// settled waits until every server names the same leader of the claims'
// stream, that server leads it, and every replica is current; it returns
// how long that took. A server cut off from its stream peers calls
// elections nobody hears, so it comes back with a higher raft term, and
// nats-server's raft has no pre-vote: its vote request makes the leader
// step down and a new election runs (4 to 9 s each, more when votes
// split), during which no node writes its claims and every gate shuts.
// The lease-bound waits after a heal start once this is over: they are
// about kvactors, not raft. A server that names the leader has taken its
// term, so no further election follows from the cut. (Current alone is
// not enough: a replica that knows no leader reports current.)
func (r *routeCut) settled() time.Duration {
	r.t.Helper()
	const stream = "KV_kvactors_owners"
	start := time.Now()
	testkit.Eventually(r.t, 60*time.Second, 20*time.Millisecond, func() error {
		leader := ""
		for i := range 3 {
			s := r.rc.Server(i)
			d, err := s.JszAccount(&server.JSzOptions{Account: "$G", Streams: true})
			if err != nil {
				return fmt.Errorf("server %d: %w", i, err)
			}
			named := ""
			for _, sd := range d.Streams {
				if sd.Name == stream && sd.Cluster != nil {
					named = sd.Cluster.Leader
				}
			}
			switch {
			case named == "":
				return fmt.Errorf("server %d knows no leader of the claims' stream", i)
			case leader == "":
				leader = named
			case named != leader:
				return fmt.Errorf("servers name leaders %q and %q", leader, named)
			}
			if !s.JetStreamIsStreamCurrent("$G", stream) {
				return fmt.Errorf("server %d's replica is not current", i)
			}
			if s.Name() == leader && !s.JetStreamIsStreamLeader("$G", stream) {
				return fmt.Errorf("server %d is named leader but does not lead", i)
			}
		}
		return nil
	})
	return time.Since(start)
}

// node starts node id connected to server s alone (it stays there: no
// server stops), with the shortest lease.
func (r *routeCut) node(s int, id, standbyFor string) *env {
	r.t.Helper()
	logs := &testkit.SyncBuffer{}
	e := r.kc.startNode(s, id, func(_ int, c *node.Config) {
		c.NATSURL, c.Lease, c.StandbyFor = r.rc.URL(s), cutLease, standbyFor
		c.Log = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	r.t.Cleanup(func() {
		if r.t.Failed() { // a route-cut failure is a timing story: show what each node warned of
			r.t.Logf("node %s (server %d) warned:\n%s", id, s, logs.String())
		}
	})
	r.kc.nodes = append(r.kc.nodes, e)
	return e
}

// cutEngine is engine e1, the Go SDK, connected to one server, naming its
// node; it records every release handed to it.
type cutEngine struct {
	t  *testing.T
	c  *client.Client
	mu sync.Mutex
	// rel is each request's releases; done the requests finished, in order.
	rel  map[string][]client.Release
	done []string
}

func (r *routeCut) engine(s int, named string) *cutEngine {
	t := r.t
	t.Helper()
	seg, err := shm.Create(r.kc.dir, "e1-seg", 64*256)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Remove() })
	spec := messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 64, Node: named,
		Segments: []messages.Segment{{Shm: seg.Name()}},
		Groups: []messages.GroupSpec{{Kind: "full", TokensPerBlock: 4,
			Regions: []messages.Region{{Segment: 0, BlockStride: 256, BlockBytes: 256}}}}}
	nc, err := nats.Connect(r.rc.URL(s), append(client.Options("e1"), nats.DontRandomize())...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	e := &cutEngine{t: t, rel: map[string][]client.Release{}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	e.c, err = client.Connect(ctx, nc, client.Config{Engine: "e1", Spec: spec, RequestTimeout: cutLease,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		OnReleased: func(rl client.Release) {
			e.mu.Lock()
			defer e.mu.Unlock()
			e.rel[rl.Request] = append(e.rel[rl.Request], rl)
		}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.c.Close() })
	return e
}

// step is one scheduler step of a one-chunk request that finishes at once:
// it is owed exactly one release, whatever happens to its node.
func (e *cutEngine) step() {
	e.t.Helper()
	req := fmt.Sprintf("r%d", len(e.done)+1)
	block := []uint32{uint32(len(e.done)%60 + 1)}
	require.NoError(e.t, e.c.Added(req, 4))
	require.NoError(e.t, e.c.Hashes(req, 0, []byte(req)))
	require.NoError(e.t, e.c.Blocks(req, 0, 0, block))
	require.NoError(e.t, e.c.Tokens(req, 4, 4))
	require.NoError(e.t, e.c.Finished(req, false, 4, 4))
	require.NoError(e.t, e.c.Flush())
	e.done = append(e.done, req)
}

// unreleased lists the finished requests with no release yet, and fails
// the test on a request released twice or a release of one never finished.
func (e *cutEngine) unreleased() []string {
	e.t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []string
	for _, req := range e.done {
		switch n := len(e.rel[req]); {
		case n == 0:
			out = append(out, req)
		case n > 1:
			e.t.Fatalf("%s released %d times: %+v", req, n, e.rel[req])
		}
	}
	require.LessOrEqual(e.t, len(e.rel), len(e.done), "releases of requests never finished: %+v", e.rel)
	return out
}

// reasons counts the releases by reason.
func (e *cutEngine) reasons() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := map[string]int{}
	for _, rs := range e.rel {
		for _, rl := range rs {
			out[rl.Reason]++
		}
	}
	return out
}

// servedBy waits, stepping, until the engine is registered with node id,
// live, and every request it finished has had its one release; then a
// lease of steps and quiet adds no second release. It returns when the
// first of those held: the lease of quiet after it is the check's, not
// the cluster's.
func (e *cutEngine) servedBy(id string, within time.Duration) (served time.Time) {
	e.t.Helper()
	_, served = e.servedByOneOf(within, id)
	return served
}

// servedByOneOf is servedBy for whichever of ids the engine registers
// with; it returns that one.
func (e *cutEngine) servedByOneOf(within time.Duration, ids ...string) (id string, served time.Time) {
	e.t.Helper()
	testkit.Eventually(e.t, within, 50*time.Millisecond, func() error {
		e.step()
		st := e.c.Stats()
		if !slices.Contains(ids, st.Node) || !e.c.Live() {
			return fmt.Errorf("engine registered with %q, live %v, want one of %v (stats %+v)", st.Node, e.c.Live(),
				ids, st)
		}
		id = st.Node
		if left := e.unreleased(); len(left) > 1 { // the step just made may still be on its way
			return fmt.Errorf("%d requests not released: %v", len(left), left)
		}
		return nil
	})
	served = time.Now()
	testkit.Eventually(e.t, 2*cutLease, 10*time.Millisecond, func() error {
		if left := e.unreleased(); len(left) > 0 {
			return fmt.Errorf("requests not released: %v", left)
		}
		return nil
	})
	quiet := time.Now().Add(cutLease)
	for time.Now().Before(quiet) {
		e.step()
		testkit.Eventually(e.t, 2*cutLease, 5*time.Millisecond, func() error {
			if left := e.unreleased(); len(left) > 0 {
				return fmt.Errorf("requests not released: %v", left)
			}
			return nil
		})
	}
	st := e.c.Stats()
	require.Zero(e.t, st.UnexpectedRel, "releases for requests not waiting for one: %+v", st)
	require.Equal(e.t, id, st.Node)
	return id, served
}

// servingWatch samples, every millisecond until stopped, which nodes'
// gates serve the engine: two at once fails the test. A sample reads one
// node's gate, then takes the time, then asks the other about that time:
// the first holding a claim then proves its write acknowledged before it,
// so two yeses are an overlap, never an artefact of the sampling.
type servingWatch struct {
	mu          sync.Mutex
	first, last map[string]time.Time
	overlap     string
	end         func() // stops the watch; waits for a look in progress
}

func watchServing(t *testing.T, engine string, nodes ...*env) *servingWatch {
	w := &servingWatch{first: map[string]time.Time{}, last: map[string]time.Time{}}
	w.end = testkit.Every(t, time.Millisecond, func() {
		for i, a := range nodes {
			for j, b := range nodes {
				if i == j || !a.node.ServingEngine(engine, time.Now()) {
					continue
				}
				now := time.Now()
				w.mu.Lock()
				id := a.node.NodeID()
				if w.first[id].IsZero() {
					w.first[id] = now
				}
				w.last[id] = now
				if b.node.ServingEngine(engine, now) && w.overlap == "" {
					w.overlap = fmt.Sprintf("%s and %s both serve %s at %v", id, b.node.NodeID(), engine, now)
				}
				w.mu.Unlock()
			}
		}
	})
	return w
}

// check stops the watch and fails on an overlap seen.
func (w *servingWatch) check(t *testing.T) {
	t.Helper()
	w.end()
	w.mu.Lock()
	defer w.mu.Unlock()
	require.Empty(t, w.overlap)
}

func (w *servingWatch) span(id string) (first, last time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.first[id], w.last[id]
}

func logReleases(t *testing.T, e *cutEngine) {
	st := e.c.Stats()
	rs := e.reasons()
	keys := make([]string, 0, len(rs))
	for k := range rs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%d", k, rs[k])
	}
	t.Logf("requests %d, releases%s; registers %d, node losses %d, resyncs %v, stale releases %d",
		len(e.done), b.String(), st.Registers, st.NodeLosses, st.Resyncs, st.StaleReleases)
}
