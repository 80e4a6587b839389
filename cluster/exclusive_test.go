package cluster

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/ownership"
	"github.com/kvactors/kvactors/internal/testkit"
)

// TestOwnershipIsExclusiveUnderFaults is docs/CLUSTER.md's fencing claim
// checked on a recorded history: three nodes on a 3-server NATS cluster
// contend for two engines (registers naming no node, keep-alives every
// lease/4, an occasional release) while the node that owns something has
// its NATS link cut for two leases, again and again. Every interval in
// which a node may serve an engine (from the acknowledgement of its claim's
// write to the send time of its last successful write plus the lease less
// the clock-skew margin, Owners.Serving's rule, or its release) is
// recorded, and no two nodes' intervals for one engine may overlap. The
// cuts make the owner's claims lapse, so other nodes take over: the test
// fails if none did (a history with no handover proves nothing).
//
// It runs 6 s; KVACTORS_CHAOS_SECONDS=N runs it N seconds and, from 20 s
// on, also stops and restarts the server that leads the claims' stream
// (.ci/run runs 30 s).
func TestOwnershipIsExclusiveUnderFaults(t *testing.T) {
	run := 6 * time.Second
	if v, err := strconv.Atoi(os.Getenv("KVACTORS_CHAOS_SECONDS")); err == nil && v > 0 {
		run = time.Duration(v) * time.Second
	}
	const lease = testLease
	engines := []string{"e1", "e2"}
	c := testkit.NATSCluster(t, 3)
	openOwnersLease(t, c.Connect(0), "setup", "", 3, lease) // creates the bucket

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := newServingLog(t)
	nodes := make([]*exclusiveNode, 3)
	for i := range nodes {
		// Through a link of its own, and only to its server: a cut isolates
		// the node alone (no failover to the servers it learns of).
		l := testkit.NewLink(t, strings.TrimPrefix(c.URL(i), "nats://"))
		nc, err := nats.Connect("nats://"+l.Addr, nats.IgnoreDiscoveredServers(), nats.MaxReconnects(-1),
			nats.ReconnectWait(20*time.Millisecond), nats.Timeout(lease/2))
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		name := fmt.Sprintf("gpu-%d", i)
		o := openOwnersLease(t, nc, name, "", 3, lease)
		acks := &ackedKV{KeyValue: o.kv, at: map[string]time.Time{}}
		o.kv = acks
		nodes[i] = &exclusiveNode{name: name, link: l, o: o, acks: acks,
			log: log, engines: engines, lease: lease, rng: rand.New(rand.NewPCG(uint64(i), 7))}
	}
	wg := runNodes(ctx, nodes)

	// Faults, on the test goroutine (testkit.Cluster's methods must be):
	// cut an owner off for two leases, let it back, and again; in a long run
	// every third fault stops the claims' stream leader instead.
	deadline := time.Now().Add(run)
	cuts, stops := 0, 0
	for k := 0; time.Now().Before(deadline); k++ {
		if run >= 20*time.Second && k%3 == 2 {
			if leader := streamLeader(c); leader >= 0 {
				c.Stop(leader)
				pace(ctx, lease)
				c.Restart(leader)
				stops++
				continue
			}
		}
		victim := nodes[k%len(nodes)]
		for _, n := range nodes {
			if len(n.o.Mine()) > 0 {
				victim = n
				break
			}
		}
		victim.link.Cut()
		pace(ctx, 2*lease)
		victim.link.Restore()
		cuts++
		pace(ctx, lease/2)
	}
	cancel()
	wg.Wait()
	handovers := log.check(t)
	ops := 0
	for _, n := range nodes {
		ops += n.ops
	}
	t.Logf("%v: %d cuts, %d leader stops, %d claim calls, %d handovers", run, cuts, stops, ops, handovers)
	require.Positive(t, handovers, "no engine changed hands: the faults exercised nothing")
}

// exclusiveNode is one contender of TestOwnershipIsExclusiveUnderFaults:
// one goroutine, one call at a time, as a node's ingest and keep-alive
// loops would make them, recording what each call left it holding.
type exclusiveNode struct {
	name    string
	link    *testkit.Link
	o       *Owners
	acks    *ackedKV
	log     *servingLog
	engines []string
	lease   time.Duration
	rng     *rand.Rand
	ops     int
	// leaves: one call in leaves (0: none) gives a held engine up as a
	// graceful shutdown does (Leave, a closed marker) rather than Release.
	leaves int
	// releases: one call in releases (0: 20) releases a held engine.
	releases int
	calls    *callLog // nil: not recorded
}

func (n *exclusiveNode) run(ctx context.Context) {
	tick := time.NewTicker(n.lease / 16)
	defer tick.Stop()
	nextBeat := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		n.ops++
		call, stop := context.WithTimeout(ctx, n.lease)
		switch {
		case time.Now().After(nextBeat):
			nextBeat = time.Now().Add(n.lease / 4)
			for _, e := range n.o.Mine() {
				start := time.Now()
				rev, err := n.o.KeepAlive(call, e)
				n.calls.add(n.name, "keep-alive", e, start, fmt.Sprintf("rev %d, %v", rev, err))
				n.after(e, err)
			}
		case n.leaves > 0 && n.rng.IntN(n.leaves) == 0 && len(n.o.Mine()) > 0:
			e, start := n.o.Mine()[0], time.Now()
			n.log.ended(n.name, e, start) // it stops serving as the leave begins
			err := n.o.Leave(call, e)
			n.calls.add(n.name, "leave", e, start, fmt.Sprint(err))
		case n.rng.IntN(cmp.Or(n.releases, 20)) == 0 && len(n.o.Mine()) > 0:
			e, start := n.o.Mine()[0], time.Now()
			n.log.ended(n.name, e, start) // it stops serving as the release begins
			err := n.o.Release(call, e)
			n.calls.add(n.name, "release", e, start, fmt.Sprint(err))
		default:
			e, start := n.engines[n.rng.IntN(len(n.engines))], time.Now()
			d, err := n.o.Resolve(call, e, Request{Register: true, Local: true})
			n.calls.add(n.name, "resolve", e, start, fmt.Sprintf("%v %s (%s), %v", d.Action, d.Owner, d.Reason, err))
			if err == nil && d.Action == ownership.Ignore {
				n.log.ended(n.name, e, time.Now()) // another owner: this one's lease is over
			}
			n.after(e, err)
		}
		stop()
	}
}

// after records what a claim call left the node holding.
func (n *exclusiveNode) after(engine string, err error) {
	n.o.mu.Lock()
	h, ok := n.o.mine[engine]
	n.o.mu.Unlock()
	if now := time.Now(); n.o.Serving(engine, now) != (ok && now.Before(h.renewed.Add(n.o.cfg.ServeFor()))) {
		n.log.disagree(fmt.Sprintf("%s %s: Serving disagrees with the claim's renewal at %s", n.name, engine,
			now.Format("15:04:05.000")))
	}
	switch {
	case ok:
		n.log.held(n.name, engine, n.acks.ackedAt(engine), h.renewed, n.o.cfg.ServeFor())
	case errors.Is(err, ErrFenced) || errors.Is(err, ErrNotMine):
		n.log.ended(n.name, engine, time.Now())
	}
}

// streamLeader is the (first) server leading the claims' stream, or -1.
func streamLeader(c *testkit.Cluster) int {
	if leaders := streamLeaders(c); len(leaders) > 0 {
		return leaders[0]
	}
	return -1
}

// streamLeaders lists the servers that take themselves for the claims'
// stream's leader (more than one while a deposed leader has not heard).
func streamLeaders(c *testkit.Cluster) []int {
	var out []int
	for i := range c.Size() {
		if s := c.Server(i); s != nil && s.JetStreamIsStreamLeader("$G", "KV_kvactors_owners") {
			out = append(out, i)
		}
	}
	return out
}

// pace waits d (the fault schedule's own timing, not a synchronisation)
// or until ctx ends.
func pace(ctx context.Context, d time.Duration) { _ = pause(ctx, d) }

// grant is an interval in which a node may serve an engine.
type grant struct {
	node     string
	from, to time.Time
}

// servingLog records each node's grants per engine (exclusiveness).
type servingLog struct {
	mu       sync.Mutex
	open     map[[2]string]*grant // node, engine
	done     map[string][]grant   // engine
	disagree func(string)         // a sample where Serving says otherwise
}

func newServingLog(t *testing.T) *servingLog {
	return &servingLog{open: map[[2]string]*grant{}, done: map[string][]grant{},
		disagree: func(msg string) { t.Error(msg) }}
}

// held is called after a call of node's that left it holding engine's
// claim, last written at renewed and acknowledged at acked: the grant runs
// on to renewed + serveFor, the lease less the clock-skew margin
// (Owners.Serving's rule, checked against it at each call), continuing the
// open one unless that had already ended. Not to renewed + the full lease:
// docs/CLUSTER.md lets the servers expire a record up to the margin early
// (the storing leader's clock; once, under load with leader stops, 10.6 ms
// before renewed + lease here), which is what the margin is for.
func (s *servingLog) held(node, engine string, acked, renewed time.Time, serveFor time.Duration) {
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	k := [2]string{node, engine}
	g := s.open[k]
	if g != nil && g.to.Before(now) {
		s.closeLocked(k, g.to)
		g = nil
	}
	if g == nil {
		if !renewed.Add(serveFor).After(now) {
			return // held, but lapsed: not serving
		}
		// From when its claim's write was acknowledged: the claim cannot
		// serve sooner (Owners sets it after), and the call's return may
		// come much later on a busy machine, hiding an overlap.
		g = &grant{node: node, from: acked, to: renewed.Add(serveFor)}
		s.open[k] = g
		return
	}
	if to := renewed.Add(serveFor); to.After(g.to) {
		g.to = to
	}
}

// ended: node stopped serving engine by at (a release began, a fence or
// another owner was seen).
func (s *servingLog) ended(node, engine string, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := [2]string{node, engine}
	if g := s.open[k]; g != nil {
		s.closeLocked(k, at)
	}
}

func (s *servingLog) closeLocked(k [2]string, at time.Time) {
	g := s.open[k]
	if at.Before(g.to) {
		g.to = at
	}
	delete(s.open, k)
	s.done[k[1]] = append(s.done[k[1]], *g)
}

// check closes every open grant and returns, per engine, the grants in
// time order, failing on any two of different nodes that overlap.
func (s *servingLog) check(t *testing.T) (handovers int) {
	s.mu.Lock()
	for k, g := range s.open {
		s.closeLocked(k, g.to)
	}
	s.mu.Unlock()
	for engine, gs := range s.done {
		slices.SortFunc(gs, func(a, b grant) int { return a.from.Compare(b.from) })
		for i, a := range gs {
			for _, b := range gs[i+1:] {
				if b.from.After(a.to) || b.from.Equal(a.to) {
					break
				}
				if a.node != b.node {
					t.Errorf("engine %s: %s served until %s and %s from %s (%v overlap)", engine, a.node,
						a.to.Format("15:04:05.000"), b.node, b.from.Format("15:04:05.000"), a.to.Sub(b.from))
				}
			}
			if i > 0 && gs[i-1].node != a.node {
				handovers++
			}
		}
	}
	return handovers
}

// ackedKV notes when each successful claim write (create or update) of an
// engine's record came back: the earliest its Owners can serve on it.
type ackedKV struct {
	jetstream.KeyValue
	mu sync.Mutex
	at map[string]time.Time
}

func (k *ackedKV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	rev, err := k.KeyValue.Create(ctx, key, value, opts...)
	k.acked(key, err)
	return rev, err
}

func (k *ackedKV) Update(ctx context.Context, key string, value []byte, revision uint64) (uint64, error) {
	rev, err := k.KeyValue.Update(ctx, key, value, revision)
	k.acked(key, err)
	return rev, err
}

func (k *ackedKV) acked(key string, err error) {
	if err == nil {
		now := time.Now()
		k.mu.Lock()
		k.at[key] = now
		k.mu.Unlock()
	}
}

// ackedAt is when key's last successful write came back.
func (k *ackedKV) ackedAt(key string) time.Time {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.at[key]
}

// runNodes runs each node's contention loop on a goroutine of its own
// until ctx ends; Wait on the group returned waits for them.
func runNodes(ctx context.Context, nodes []*exclusiveNode) *sync.WaitGroup {
	var wg sync.WaitGroup
	for _, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n.run(ctx)
		}()
	}
	return &wg
}
