package node_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// catchUpLease is the lease of the catch-up tests: the outages they cause
// last well under it, so the feed never expires the other node (a node that
// comes back from expiry is caught up anyway, which would hide a missing
// hookup). Long, because a store of n0's under a loaded -race run must not
// meet a lease-bound refusal (the engine heard lease/2 ago, a lapse, an
// expired claim): 4 s once left "fresh stored by A" unanswered after the
// 64 MiB flood. The catch-ups come at n0's heartbeats, every lease/4.
const catchUpLease = 10 * time.Second

// catchUpCluster is n0 and n1 on servers 0 and 1 of a NATS cluster, n0's
// pool two chunks (a second prefix evicts the first), the engines ea on n0
// and ec on n1, both in namespace "m", registered, and the prefix old
// stored by ea and counted by ec's lookup. n1 starts only once ea has
// registered and stored: its first catch-up of n0 brings it old, and no
// catch-up of n0 is still owed (which would hide a missing hookup).
// mutate1 changes n1's Config.
func catchUpCluster(t *testing.T, old []string, mutate1 func(kc *kvCluster, c *node.Config)) (kc *kvCluster, a, c *testEngine) {
	t.Helper()
	kc = &kvCluster{t: t, nats: testkit.NATSCluster(t, 3), dir: t.TempDir()}
	lease := func(_ int, c *node.Config) { c.Lease = catchUpLease }
	kc.nodes = append(kc.nodes, kc.startNode(0, "n0", lease, func(_ int, c *node.Config) { c.PoolBytes = 512 })) // two 256-byte chunks
	a = kc.engineOn(0, "ea", "m")
	a.register()
	a.storePrefix("old", old, 40, 41, 7, "old stored by A")
	kc.nodes = append(kc.nodes, kc.startNode(1, "n1", lease, func(_ int, c *node.Config) { mutate1(kc, c) }))
	kc.waitSeen()
	c = kc.engineOn(1, "ec", "m")
	c.register()
	awaitLookup(t, c, old, 8, "n1 of A's prefix")
	return kc, a, c
}

// evict stores the prefix fresh on a's node, whose two-chunk pool held old:
// old is evicted (its BlockRemoved published) to make room.
func evict(t *testing.T, a *testEngine, old, fresh []string) {
	t.Helper()
	a.storePrefix("fresh", fresh, 50, 51, 8, "fresh stored by A")
	require.ElementsMatch(t, old, recvKVHashes(t, a, messages.KVBlockRemoved, messages.MediumCPU, "", len(old)),
		"A evicted the old prefix for the fresh one")
}

// beat heartbeats each engine: a slow run (-race) may have kept them
// silent for most of a lease since they registered, and an expired engine
// is not answered.
func beat(t *testing.T, tes ...*testEngine) {
	t.Helper()
	for _, te := range tes {
		require.Empty(t, te.heartbeat(te.epoch, te.seq).Error, "heartbeat of %s", te.id)
	}
}

// awaitCaughtUp waits until c's node counts nothing of old, which another
// node evicted while c's node missed its BlockRemoved, and all of fresh,
// which it stored meanwhile: the catch-up of that node's key set ran.
func awaitCaughtUp(t *testing.T, c *testEngine, old, fresh []string, why string) {
	t.Helper()
	counted := -1 // what n1 last answered
	testkit.Eventually(t, 2*catchUpLease, 20*time.Millisecond, func() error {
		got, err := c.tryLookup(old, time.Second)
		if err != nil {
			return fmt.Errorf("%w (n1 last counted %d tokens of the prefix n0 evicted)", err, counted)
		}
		if counted = got; got != 0 {
			return fmt.Errorf("n1 still counts %d tokens of the prefix n0 evicted (%s, and no catch-up followed)", got, why)
		}
		return nil
	})
	awaitLookup(t, c, fresh, 8, "n1 of the prefix n0 stored meanwhile")
}

// docs/CLUSTER.md failure table, "this node reconnects to NATS (kv_events
// missed)", through the node's own wiring (its reconnect handler calls
// the feed's Reconnected): n1 is cut off from NATS while n0 evicts a
// prefix n1 counted; back on NATS, n1 stops counting it within a few
// heartbeats, and counts what n0 stored meanwhile. n1 dials its server
// through a link and ignores the servers it learns of, so the cut is an
// outage rather than a failover.
func TestClusterNodeCatchesUpAfterReconnecting(t *testing.T) { // not parallel: a lease-bound flood under -race
	old := []string{hash("old", 0), hash("old", 1)}
	fresh := []string{hash("fresh", 0), hash("fresh", 1)}
	var link *testkit.Link
	kc, a, c := catchUpCluster(t, old, func(kc *kvCluster, cfg *node.Config) {
		link = testkit.NewLink(t, strings.TrimPrefix(kc.nats.URL(1), "nats://"))
		cfg.NATSURL = "nats://" + link.Addr
		node.WithNATSOptions(nats.IgnoreDiscoveredServers())(cfg)
	})

	n1 := kc.nodes[1]
	reconnects := n1.counter("kvactors_nats_events_total", "reconnect")
	beat(t, a, c)
	cut := time.Now()
	link.Cut()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if n1.counter("kvactors_nats_events_total", "disconnect") == 0 {
			return errors.New("n1 has not seen its connection drop")
		}
		return nil
	})
	evict(t, a, old, fresh) // its kv_events never reach n1
	link.Restore()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if n1.counter("kvactors_nats_events_total", "reconnect") == reconnects {
			return errors.New("n1 has not reconnected")
		}
		return nil
	})
	// Back well within the lease: n1's feed still holds n0 live (an expired
	// node is caught up when heard again, hookup or not).
	require.Less(t, time.Since(cut), catchUpLease/2, "the outage outlasted half a lease")
	awaitCaughtUp(t, c, old, fresh, "its BlockRemoved went out while n1 was cut off")
}

// holdLog is a slog handler that discards every record but holds the
// first whose message is msg until release: the goroutine logging it (a
// NATS subscription's) takes nothing more meanwhile. Safe for concurrent
// use.
type holdLog struct {
	msg     string
	once    *sync.Once
	entered chan struct{}
	release chan struct{}
}

func newHoldLog(msg string) *holdLog {
	return &holdLog{msg: msg, once: &sync.Once{}, entered: make(chan struct{}, 1), release: make(chan struct{})}
}

func (h *holdLog) Enabled(context.Context, slog.Level) bool { return true }
func (h *holdLog) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *holdLog) WithGroup(string) slog.Handler            { return h }

func (h *holdLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message != h.msg {
		return nil
	}
	held := false
	h.once.Do(func() { held = true; h.entered <- struct{}{} })
	if held {
		select {
		case <-h.release:
		case <-time.After(time.Minute): // never outlive a failed test for long
		}
	}
	return nil
}

// docs/CLUSTER.md failure table, "NATS drops kv_events for the feed (slow
// consumer)", through the node's own wiring (the connection's error handler
// routes ErrSlowConsumer to the feed's Dropped): n1's feed is held inside
// its kv_events handler (it logs a refused batch to a log that holds it),
// its pending queue is filled to one byte under nats.go's limit, and n0
// evicts a prefix n1 counted: NATS drops that BlockRemoved for real. n1
// stops counting the prefix, from the catch-up at n0's next heartbeat,
// while the handler is still held.
func TestClusterNodeCatchesUpAfterNATSDroppedItsKVEvents(t *testing.T) { // not parallel: a lease-bound flood under -race
	hold := newHoldLog("kv_events refused")
	t.Cleanup(sync.OnceFunc(func() { close(hold.release) }))
	old := []string{hash("old", 0), hash("old", 1)}
	fresh := []string{hash("fresh", 0), hash("fresh", 1)}
	kc, a, c := catchUpCluster(t, old, func(_ *kvCluster, cfg *node.Config) { cfg.Log = slog.New(hold) })
	n1 := kc.nodes[1]

	// A batch the feed refuses (group -1) from a node that is not there: the
	// handler logs it and is held.
	pub := kc.nats.Connect(1)
	subj := "kvactors.ghost." + messages.VerbKVEvents
	spy, err := pub.SubscribeSync(subj)
	require.NoError(t, err)
	body, err := json.Marshal(messages.KVEventBatch{Events: []messages.KVEvent{{Type: messages.KVBlockStored,
		BlockHashes: []string{"aa"}, GroupIdx: -1, Medium: messages.MediumCPU}}})
	require.NoError(t, err)
	bad := &nats.Msg{Subject: subj, Data: body, Header: nats.Header{}}
	bad.Header.Set(messages.HeaderNode, "ghost")
	bad.Header.Set(messages.HeaderBoot, "b0")
	bad.Header.Set(messages.HeaderGeometry, "0000000000000001")
	require.NoError(t, pub.PublishMsg(bad))
	testkit.Recv(t, hold.entered, 5*time.Second, "n1's feed held in its kv_events handler")
	got, err := spy.NextMsg(5 * time.Second)
	require.NoError(t, err)
	// nats.go counts a message's body and headers as pending until its
	// handler returns (Msg.Size less subject and reply), and drops what
	// would pass the limit.
	held := got.Size() - len(got.Subject) - len(got.Reply)
	require.NoError(t, spy.Unsubscribe())

	// Fill the feed's queue to one byte under the limit: bodies without
	// headers, the largest last. Every body counts as pending, the flood
	// is unattributed (no node header) once it is handled.
	room := nats.DefaultSubPendingBytesLimit - held - 1
	size := int(pub.MaxPayload())
	var bodies []int
	if r := room % size; r > 0 {
		bodies = append(bodies, r)
	}
	for range room / size {
		bodies = append(bodies, size)
	}
	// n0 subscribes to kv_events too and receives the flood: each body
	// waits until both nodes have read it, so no server queues enough for
	// either to be its slow consumer (the server would cut it off).
	flood := "kvactors.flood." + messages.VerbKVEvents
	n0 := kc.nodes[0]
	from0, from1 := n0.node.NATSStats().InBytes, n1.node.NATSStats().InBytes
	want0, want1 := from0, from1
	for i, b := range bodies {
		if i%8 == 0 {
			beat(t, a, c) // a flood under -race can outlast a lease
		}
		require.NoError(t, pub.Publish(flood, make([]byte, b)))
		want0, want1 = want0+uint64(b), want1+uint64(b)
		testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
			if got0, got1 := n0.node.NATSStats().InBytes, n1.node.NATSStats().InBytes; got0 < want0 || got1 < want1 {
				return fmt.Errorf("n0 has read %d, n1 %d of the flood's first %d bytes", got0-from0, got1-from1, want1-from1)
			}
			return nil
		})
	}
	for _, e := range kc.nodes {
		require.Zero(t, e.counter("kvactors_nats_events_total", "slow_consumer"), "the flood alone fits the feeds' queues")
		require.Zero(t, e.counter("kvactors_nats_events_total", "disconnect"), "no server cut a node off")
	}

	beat(t, a, c)
	evict(t, a, old, fresh) // n0's kv_events pass the limit: dropped
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if n1.counter("kvactors_nats_events_total", "slow_consumer") == 0 {
			return errors.New("NATS has not dropped n0's kv_events for n1's feed")
		}
		return nil
	})
	awaitCaughtUp(t, c, old, fresh, "NATS dropped its BlockRemoved")
	for _, e := range kc.nodes {
		require.Zero(t, e.counter("kvactors_nats_events_total", "disconnect"), "%s kept its connection: no reconnect caught it up", e.node.NodeID())
	}
}
