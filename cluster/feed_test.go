package cluster

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/holders"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// fakeNode plays another node on the wire: hello and heartbeats every
// lease/4, a key set for catch-up, kv_events with its headers.
type fakeNode struct {
	t          *testing.T
	nc         *nats.Conn
	node, boot string
	stopBeats  func()
	keysSub    *nats.Subscription
	keys       *swappableKeys
}

// swappableKeys is a KeySource whose set a test replaces, as if the node's
// pool changed while its kv_events were lost.
type swappableKeys struct {
	mu   sync.Mutex
	keys SortedKeys
	asks atomic.Int64 // KeysAfter calls: about one per page served
}

func (s *swappableKeys) set(keys []holders.NSKey) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.keys = NewSortedKeys(keys)
}

func (s *swappableKeys) KeysAfter(after holders.NSKey, max int) []holders.NSKey {
	s.asks.Add(1)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.keys.KeysAfter(after, max)
}

func startFakeNode(t *testing.T, nc *nats.Conn, node, boot string, keys []holders.NSKey) *fakeNode {
	n := &fakeNode{t: t, nc: nc, node: node, boot: boot, keys: &swappableKeys{}}
	n.keys.set(keys)
	sub, err := ServeKeys(nc, "kvactors", node, boot, n.keys)
	require.NoError(t, err)
	n.keysSub = sub
	require.NoError(t, nc.Flush())
	hello, _ := json.Marshal(messages.Hello{Node: node, Boot: boot, LeaseMS: testLease.Milliseconds()})
	require.NoError(t, nc.Publish(messages.NodeSubject("kvactors", node, messages.NodeVerbHello), hello))
	hb, _ := json.Marshal(messages.NodeHeartbeat{Node: node, Boot: boot, Engines: 1})
	n.stopBeats = testkit.Every(t, testLease/4, func() {
		_ = nc.Publish(messages.NodeSubject("kvactors", node, messages.NodeVerbHeartbeat), hb)
	})
	t.Cleanup(n.kill)
	return n
}

// kill stops the heartbeats and the key service, as a SIGKILL would; it
// returns when the last heartbeat has been published.
func (n *fakeNode) kill() {
	n.stopBeats()
	_ = n.keysSub.Unsubscribe()
	_ = n.nc.Flush()
}

func (n *fakeNode) kvEvents(engine string, evs ...messages.KVEvent) {
	b, _ := json.Marshal(messages.KVEventBatch{Events: evs})
	m := nats.NewMsg(messages.EngineSubject("kvactors", engine, messages.VerbKVEvents))
	m.Data = b
	m.Header.Set(HeaderNode, n.node)
	m.Header.Set(HeaderBoot, n.boot)
	m.Header.Set(messages.HeaderGeometry, messages.GeometryHex(testGeometry))
	require.NoError(n.t, n.nc.PublishMsg(m))
}

// testGeometry is the geometry fingerprint fake nodes stamp on their
// kv_events (messages.HeaderGeometry).
const testGeometry = 0x6e0

func hashKey(h string, g int) holders.NSKey {
	raw, _ := hex.DecodeString(h)
	return holders.NSKey{NS: messages.ClusterNamespace(messages.NamespaceKey("e1", "m"), testGeometry), Key: holders.KeyOf(raw, g)} // shared namespace "m"
}

func holdersOf(f *Feed, k holders.NSKey) func() error {
	return func() error {
		if got := f.Holders(k.NS, k.Key); len(got) != 1 || got[0] != "gpu-0" {
			return fmt.Errorf("holders of %x: %v, want [gpu-0]", []byte(k.Key), got)
		}
		return nil
	}
}

// A node's keys become known to a node on another server by catch-up and
// by kv_events; it stops counting within the lease once its heartbeats
// stop; its next boot counts only what that boot holds.
func TestFeedTracksAnotherNodesKeysAcrossServersAndDropsItWithinTheLease(t *testing.T) {
	ncA, feed := feedAcrossServers(t)

	old := hashKey("aa", 0)
	a := startFakeNode(t, ncA, "gpu-0", "a1", []holders.NSKey{old})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, old)) // by catch-up

	stored := hashKey("bb", 1)
	a.kvEvents("e1", messages.KVEvent{Type: messages.KVBlockStored, BlockHashes: []string{"bb"}, GroupIdx: 1, Namespace: "m"})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, stored)) // by kv_events
	a.kvEvents("e1", messages.KVEvent{Type: messages.KVBlockRemoved, BlockHashes: []string{"bb"}, GroupIdx: 1, Namespace: "m"})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if got := feed.Holders(stored.NS, stored.Key); len(got) != 0 {
			return fmt.Errorf("still held by %v after BlockRemoved", got)
		}
		return nil
	})
	// A subject that names no engine is counted as a bad message.
	bad := nats.NewMsg("kvactors._x.kv_events")
	bad.Header.Set(HeaderNode, "gpu-0")
	bad.Header.Set(HeaderBoot, "a1")
	bad.Data = []byte(`{"events":[]}`)
	require.NoError(t, ncA.PublishMsg(bad))
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if fs, _ := feed.Stats(); fs.BadMessages != 1 {
			return fmt.Errorf("%d bad messages, want 1", fs.BadMessages)
		}
		return nil
	})
	// Events without the node headers are counted, not guessed at.
	require.NoError(t, ncA.Publish(messages.EngineSubject("kvactors", "e1", messages.VerbKVEvents), []byte(`{"events":[]}`)))
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if fs, _ := feed.Stats(); fs.Unattributed != 1 {
			return fmt.Errorf("%d unattributed batches, want 1", fs.Unattributed)
		}
		return nil
	})

	// This node missed kv_events while away from NATS: after Reconnected,
	// the next heartbeat catches the node up again.
	missed := hashKey("dd", 0)
	a.keys.set([]holders.NSKey{old, missed})
	feed.Reconnected()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, missed))

	// "A node that is gone stops counting as a holder within lease_ms."
	a.kill()
	killed := time.Now()
	testkit.Eventually(t, 3*testLease, 10*time.Millisecond, func() error {
		if got := feed.Holders(old.NS, old.Key); len(got) != 0 {
			return fmt.Errorf("gpu-0 still counts %v after %v", got, time.Since(killed))
		}
		return nil
	})
	// Holders reads the clock, so the drop is due a lease after the last
	// heartbeat (before the kill); the slack is for polling on a loaded
	// machine (-race on two cores), not for the mechanism.
	require.LessOrEqual(t, time.Since(killed), testLease+testLease/2, "dropped within the lease (plus polling)")

	// A new boot counts only what it holds.
	fresh := hashKey("cc", 0)
	startFakeNode(t, ncA, "gpu-0", "a2", []holders.NSKey{fresh})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, fresh))
	require.Empty(t, feed.Holders(old.NS, old.Key))
}

// A catch-up replaces what the index held of the node: a key it evicted
// while this node missed its kv_events (the case Reconnected exists for)
// no longer counts once the catch-up is done. Before, a catch-up only
// added keys, and the node counted as the key's holder for good.
func TestFeedCatchUpDropsAKeyEvictedWhileEventsWereMissed(t *testing.T) {
	ncA, feed := feedAcrossServers(t)
	old := hashKey("aa", 0)
	a := startFakeNode(t, ncA, "gpu-0", "a1", []holders.NSKey{old})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, old))

	// While this node was away, gpu-0 evicted "aa" and stored "dd".
	missed := hashKey("dd", 0)
	a.keys.set([]holders.NSKey{missed})
	feed.Reconnected()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, missed)) // the catch-up ran
	testkit.Eventually(t, 2*testLease, 10*time.Millisecond, func() error {
		if got := feed.Holders(old.NS, old.Key); len(got) != 0 {
			return fmt.Errorf("gpu-0 no longer holds aa, still counted by %v after the catch-up", got)
		}
		return nil
	})
	testkit.Eventually(t, time.Second, 10*time.Millisecond, holdersOf(feed, missed))
}

// A node that was cut off and reconnects says hello again: its kv_events
// while away were lost, and it clears only the namespaces an engine is
// registered in, so a chunk it evicted meanwhile from any other would stay
// counted here. The hello asks for its key set: the evicted key goes.
func TestFeedCatchesUpANodeThatSaysHelloAgain(t *testing.T) {
	ncA, feed := feedAcrossServers(t)
	old := hashKey("aa", 0)
	a := startFakeNode(t, ncA, "gpu-0", "a1", []holders.NSKey{old})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, old))
	first := a.keys.asks.Load() // the first catch-up's pages (it listed aa)

	// Cut off, gpu-0 evicted "aa" (its BlockRemoved lost), then reconnected.
	a.keys.set(nil)
	hello, _ := json.Marshal(messages.Hello{Node: "gpu-0", Boot: "a1", LeaseMS: testLease.Milliseconds()})
	require.NoError(t, ncA.Publish(messages.NodeSubject("kvactors", "gpu-0", messages.NodeVerbHello), hello))
	testkit.Eventually(t, 2*testLease, 10*time.Millisecond, func() error {
		if got := feed.Holders(old.NS, old.Key); len(got) != 0 {
			return fmt.Errorf("gpu-0 no longer holds aa, still counted by %v after its hello (pages served %d, %d before)",
				got, a.keys.asks.Load(), first)
		}
		return nil
	})
	require.Greater(t, a.keys.asks.Load(), first, "its key set was asked for again")
}

// A reconnecting node's hello is followed by its re-announce's clears: a
// catch-up begun at the hello would be cut short by them, or finish and be
// asked again, paging the node's whole set twice at every reconnect. The
// hello of a node still live only marks it; its next heartbeat starts one
// catch-up, after the clears.
func TestFeedPagesAReconnectingNodeOnce(t *testing.T) {
	ncA, feed := feedAcrossServers(t)
	held, other := hashKey("aa", 0), hashKey("bb", 0)
	a := startFakeNode(t, ncA, "gpu-0", "a1", []holders.NSKey{held, other})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, held))
	a.stopBeats() // its beats by hand from here: it stays live for the lease
	catchUps := func() float64 {
		return testutil.ToFloat64(feed.metrics.CatchUps.WithLabelValues("ok")) +
			testutil.ToFloat64(feed.metrics.CatchUps.WithLabelValues("superseded"))
	}
	before := catchUps()

	hello, _ := json.Marshal(messages.Hello{Node: "gpu-0", Boot: "a1", LeaseMS: testLease.Milliseconds()})
	require.NoError(t, ncA.Publish(messages.NodeSubject("kvactors", "gpu-0", messages.NodeVerbHello), hello))
	a.kvEvents("e1", messages.KVEvent{Type: messages.KVAllBlocksCleared, Namespace: "m"})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if got := feed.Holders(held.NS, held.Key); len(got) != 0 {
			return fmt.Errorf("the clear not applied: aa held by %v", got)
		}
		return nil
	})
	hb, _ := json.Marshal(messages.NodeHeartbeat{Node: "gpu-0", Boot: "a1", Engines: 1})
	require.NoError(t, ncA.Publish(messages.NodeSubject("kvactors", "gpu-0", messages.NodeVerbHeartbeat), hb))
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, held)) // listed again by a catch-up
	// ... and that catch-up has ended, counted.
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		feed.mu.Lock()
		defer feed.mu.Unlock()
		if feed.catching["gpu-0"] {
			return fmt.Errorf("a catch-up of gpu-0 still running")
		}
		return nil
	})
	require.Equal(t, before+1, catchUps(), "catch-ups (ok or superseded) of gpu-0 for one reconnect")
}

// kv_events NATS dropped (the feed a slow consumer) are made good by a
// catch-up: Dropped, called from the connection's error handler, marks
// every node, and the catch-up at its next heartbeat drops the key whose
// BlockRemoved was lost.
func TestFeedCatchesUpAfterNATSDroppedItsKVEvents(t *testing.T) {
	c := testkit.NATSCluster(t, 3)
	var fp atomic.Pointer[Feed]
	ncA := c.Connect(0)
	ncC := c.Connect(2, nats.ErrorHandler(func(_ *nats.Conn, s *nats.Subscription, err error) {
		if f := fp.Load(); f != nil && errors.Is(err, nats.ErrSlowConsumer) {
			f.Dropped(s)
		}
	}))
	feed, err := StartFeed(ncC, Config{Node: "gpu-2", Lease: testLease}, slog.New(slog.DiscardHandler), nil)
	require.NoError(t, err)
	t.Cleanup(feed.Close)
	fp.Store(feed)
	require.NoError(t, ncC.Flush())
	old := hashKey("aa", 0)
	a := startFakeNode(t, ncA, "gpu-0", "a1", []holders.NSKey{old})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, old))

	var sub *nats.Subscription
	for _, s := range feed.subs {
		if strings.HasSuffix(s.Subject, messages.VerbKVEvents) {
			sub = s
		}
	}
	require.NoError(t, sub.SetPendingLimits(1, -1))
	feed.mu.Lock() // the handler blocks on the first message; one more waits, the rest are dropped
	locked := true
	defer func() {
		if locked {
			feed.mu.Unlock()
		}
	}()
	ee := hashKey("ee", 0)
	a.kvEvents("e1", messages.KVEvent{Type: messages.KVBlockStored, BlockHashes: []string{"ee"}, Namespace: "m"})
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if d, _ := sub.Delivered(); d < 1 {
			return fmt.Errorf("first kv_events not in the handler yet")
		}
		return nil
	})
	a.kvEvents("e1", messages.KVEvent{Type: messages.KVBlockStored, BlockHashes: []string{"ee"}, Namespace: "m"}) // waits
	a.keys.set([]holders.NSKey{ee})
	a.kvEvents("e1", messages.KVEvent{Type: messages.KVBlockRemoved, BlockHashes: []string{"aa"}, Namespace: "m"}) // dropped
	require.NoError(t, ncA.Flush())
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if d, _ := sub.Dropped(); d < 1 {
			return fmt.Errorf("nothing dropped yet")
		}
		return nil
	})
	feed.mu.Unlock()
	locked = false
	testkit.Eventually(t, 3*testLease, 10*time.Millisecond, func() error {
		if got := feed.Holders(old.NS, old.Key); len(got) != 0 {
			return fmt.Errorf("aa still counted for %v: its BlockRemoved was dropped and no catch-up followed", got)
		}
		return nil
	})
	testkit.Eventually(t, time.Second, 10*time.Millisecond, holdersOf(feed, ee))
}

// A node not heard is live to the feed until the feed has listened for a
// whole lease: since it started, and again since its connection's last
// reconnect (what the node said meanwhile went unheard); while cut off,
// every node is. A standby decides its takeover on this.
func TestFeedCountsSilenceOnlyOnceItHasListenedForALease(t *testing.T) {
	s := testkit.NATSServer(t)
	link := testkit.NewLink(t, s.Addr().String())
	nc, err := nats.Connect("nats://"+link.Addr, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	other := testkit.Connect(t, s)
	started := time.Now()
	feed, err := StartFeed(nc, Config{Node: "gpu-1", Lease: testLease}, slog.New(slog.DiscardHandler), nil)
	require.NoError(t, err)
	t.Cleanup(feed.Close)
	require.True(t, feed.NodeLive("gpu-0"), "not heard, but the feed has only just started")

	// gpu-0 says hello once, then nothing.
	hello, _ := json.Marshal(messages.Hello{Node: "gpu-0", Boot: "a1", LeaseMS: testLease.Milliseconds()})
	require.NoError(t, other.Publish(messages.NodeSubject("kvactors", "gpu-0", messages.NodeVerbHello), hello))
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if len(feed.Nodes()) == 0 {
			return fmt.Errorf("hello not heard")
		}
		return nil
	})
	silent := func() error {
		if feed.NodeLive("gpu-0") || feed.NodeLive("ghost") {
			return fmt.Errorf("gpu-0 or ghost still live")
		}
		return nil
	}
	testkit.Eventually(t, 5*testLease, 10*time.Millisecond, silent)
	require.GreaterOrEqual(t, time.Since(started), testLease, "silent only after a lease of listening")

	// Cut off, the feed hears nobody: everyone may be alive.
	link.Cut()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if nc.IsConnected() {
			return fmt.Errorf("still connected")
		}
		return nil
	})
	require.True(t, feed.NodeLive("gpu-0"), "cut off from NATS")
	restored := time.Now()
	link.Restore()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if !nc.IsConnected() {
			return fmt.Errorf("not reconnected")
		}
		return nil
	})
	require.True(t, feed.NodeLive("gpu-0"), "just reconnected: gpu-0's heartbeats meanwhile went unheard")
	testkit.Eventually(t, 5*testLease, 10*time.Millisecond, silent)
	require.GreaterOrEqual(t, time.Since(restored), testLease, "silent only after a lease of listening again")
}

// A key names the same bytes only under its namespace's geometry: kv_events
// without Kvactors-Geometry and keys pages of namespaces without one (a node
// of an older version) count for nobody; their stamped or qualified
// neighbours, sent the same way, do.
func TestFeedCountsNoKeyWithoutItsGeometry(t *testing.T) {
	s := testkit.NATSServer(t)
	ncA, ncC := testkit.Connect(t, s), testkit.Connect(t, s)
	feed, err := StartFeed(ncC, Config{Node: "gpu-2", Lease: testLease}, slog.New(slog.DiscardHandler), nil)
	require.NoError(t, err)
	t.Cleanup(feed.Close)
	require.NoError(t, ncC.Flush())

	paged := hashKey("cc", 0)
	plain := holders.NSKey{NS: messages.NamespaceKey("e1", "m"), Key: hashKey("aa", 0).Key}
	a := startFakeNode(t, ncA, "gpu-0", "a1", []holders.NSKey{plain, paged})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, paged)) // by catch-up
	require.Empty(t, feed.Holders(plain.NS, plain.Key), "a paged key of a namespace without its geometry")

	unstamped := nats.NewMsg(messages.EngineSubject("kvactors", "e1", messages.VerbKVEvents))
	unstamped.Header.Set(HeaderNode, "gpu-0")
	unstamped.Header.Set(HeaderBoot, "a1")
	unstamped.Data, _ = json.Marshal(messages.KVEventBatch{Events: []messages.KVEvent{
		{Type: messages.KVBlockStored, BlockHashes: []string{"bb"}, Namespace: "m"}}})
	require.NoError(t, ncA.PublishMsg(unstamped))
	a.kvEvents("e1", messages.KVEvent{Type: messages.KVBlockStored, BlockHashes: []string{"dd"}, Namespace: "m"})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, hashKey("dd", 0))) // after the unstamped one
	require.Empty(t, feed.Holders(hashKey("bb", 0).NS, hashKey("bb", 0).Key), "a stored key without its geometry")
	require.Empty(t, feed.Holders(plain.NS, hashKey("bb", 0).Key), "nor under the plain namespace")
	require.Empty(t, feed.Holders(messages.ClusterNamespace(plain.NS, 0), hashKey("bb", 0).Key),
		"nor under a geometry it never named")
}

// A node that announces more keys than the cap (Config.MaxPeerKeys), by
// catch-up and by kv_events, has only the cap indexed: the keys past it
// are counted and the crossing logged once; its catch-up stops at the
// first page that met the cap, counted ok and not retried; its removals
// still apply; and another node's keys are all indexed.
func TestFeedCapsANodesKeysAndNotAnothers(t *testing.T) {
	const maxKeys = 3
	s := testkit.NATSServer(t)
	ncA, ncC := testkit.Connect(t, s), testkit.Connect(t, s)
	m := NewMetrics(prometheus.NewRegistry())
	var logs testkit.SyncBuffer
	feed, err := StartFeed(ncC, Config{Node: "gpu-2", Lease: testLease, MaxPeerKeys: maxKeys},
		slog.New(slog.NewTextHandler(&logs, nil)), m)
	require.NoError(t, err)
	t.Cleanup(feed.Close)
	require.NoError(t, ncC.Flush())

	// gpu-0's set spans several pages (a page holds some thousands).
	const many = 20_000
	big := make([]holders.NSKey, many)
	for i := range big {
		big[i] = hashKey(fmt.Sprintf("%032x", i), 0)
	}
	small := []holders.NSKey{hashKey("b1", 0), hashKey("b2", 0)}
	// One connection for both: their kv_events reach the feed in order.
	hog := startFakeNode(t, ncA, "gpu-0", "a1", big)
	other := startFakeNode(t, ncA, "gpu-1", "b1", small)
	catchUps := func(want float64) func() error {
		return func() error {
			if got := testutil.ToFloat64(m.CatchUps.WithLabelValues("ok")); got != want {
				return fmt.Errorf("%v catch-ups ok, want %v", got, want)
			}
			return nil
		}
	}
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, catchUps(2))
	require.Zero(t, testutil.ToFloat64(m.CatchUps.WithLabelValues("error")))
	heldBy := func(k holders.NSKey) []string { return feed.Holders(k.NS, k.Key) }
	for _, k := range small {
		require.Equal(t, []string{"gpu-1"}, heldBy(k), "gpu-1's keys are its own business")
	}
	// The first keys in page order, up to the cap; nothing past it.
	for i, k := range big[:maxKeys+1] {
		if i < maxKeys {
			require.Equal(t, []string{"gpu-0"}, heldBy(k), "key %d", i)
		} else {
			require.Empty(t, heldBy(k), "key %d, past the cap", i)
		}
	}
	over := testutil.ToFloat64(m.KeysOverCap)
	require.Positive(t, over, "the first page's keys past the cap are counted")
	require.Less(t, over, float64(many-maxKeys), "the catch-up stopped at the page that met the cap")
	require.EqualValues(t, 1, hog.keys.asks.Load(), "one page of %d keys asked for, not the whole set", many)

	// kv_events: a removal applies and frees room for one store; the
	// others are left out and counted. gpu-1 stores up to the cap exactly.
	hog.kvEvents("e1",
		messages.KVEvent{Type: messages.KVBlockRemoved, BlockHashes: []string{fmt.Sprintf("%032x", 0)}, Namespace: "m"},
		messages.KVEvent{Type: messages.KVBlockStored, BlockHashes: []string{"ee01", "ee02", "ee03"}, Namespace: "m"})
	other.kvEvents("e1", messages.KVEvent{Type: messages.KVBlockStored, BlockHashes: []string{"b3"}, Namespace: "m"})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if got := heldBy(hashKey("b3", 0)); len(got) != 1 {
			return fmt.Errorf("gpu-1's third key held by %v", got)
		}
		return nil
	})
	require.Empty(t, heldBy(big[0]), "removed")
	require.Equal(t, []string{"gpu-0"}, heldBy(hashKey("ee01", 0)), "stored in the room the removal freed")
	require.Empty(t, heldBy(hashKey("ee02", 0)))
	require.Equal(t, over+2, testutil.ToFloat64(m.KeysOverCap))
	byNode := map[string]holders.NodeInfo{}
	for _, ni := range feed.Nodes() {
		byNode[ni.Node] = ni
	}
	require.Equal(t, maxKeys, byNode["gpu-0"].Keys)
	require.True(t, byNode["gpu-0"].Capped)
	require.Equal(t, maxKeys, byNode["gpu-1"].Keys)
	require.False(t, byNode["gpu-1"].Capped, "at the cap, nothing left out")

	// Not retried: two more heartbeats of gpu-0 start no catch-up.
	since := byNode["gpu-0"].LastSeen
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		for _, ni := range feed.Nodes() {
			if ni.Node == "gpu-0" && ni.LastSeen.Sub(since) >= testLease/3 {
				return nil
			}
		}
		return fmt.Errorf("no two heartbeats of gpu-0 since %v", since)
	})
	require.NoError(t, catchUps(2)())
	require.Zero(t, testutil.ToFloat64(m.CatchUps.WithLabelValues("error")))
	require.EqualValues(t, 1, hog.keys.asks.Load())

	// Logged once, for gpu-0 (the catch-up's crossing), not per key or batch.
	lines := strings.Count(logs.String(), "holders cap")
	require.Equal(t, 1, lines, "logs:\n%s", logs.String())
	require.Contains(t, logs.String(), "node=gpu-0")

	// A catch-up of a node at its cap still replaces its keys: ee01, stored
	// by kv_events but not in gpu-0's set (as if evicted while its
	// BlockRemoved was missed), goes, and the first keys in page order
	// (big[0] among them: its set still lists it) take the room, in one page.
	feed.Reconnected()
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, catchUps(4))
	require.EqualValues(t, 2, hog.keys.asks.Load(), "the reconnect's catch-up read one page, not the whole set")
	require.Empty(t, heldBy(hashKey("ee01", 0)), "not in gpu-0's set: swept though the catch-up was cut at the cap")
	for i, k := range big[:maxKeys] {
		require.Equal(t, []string{"gpu-0"}, heldBy(k), "key %d", i)
	}
	for _, ni := range feed.Nodes() {
		if ni.Node == "gpu-0" {
			require.Equal(t, maxKeys, ni.Keys)
			require.True(t, ni.Capped, "its set is still over the cap")
		}
	}
}

// A node whose BlockRemoved events this node missed while the node held
// the cap's worth of keys: the catch-up that follows (here Reconnected)
// drops the keys it evicted, and indexes the keys it holds now. Before,
// a catch-up that met the cap (on the first new key: the evicted keys
// filled it) swept nothing, so the evicted keys counted as held by it for
// good, and a load fetching one failed, while the keys it held were never
// indexed, though its whole set fits the cap.
func TestFeedCatchUpDropsEvictedKeysOfANodeAtItsCap(t *testing.T) {
	const maxKeys = 3
	ncA, feed := feedAcrossServersWith(t, Config{Node: "gpu-2", Lease: testLease, MaxPeerKeys: maxKeys})
	old := []holders.NSKey{hashKey("a1", 0), hashKey("a2", 0), hashKey("a3", 0)}
	a := startFakeNode(t, ncA, "gpu-0", "a1", old)
	for _, k := range old {
		testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, k))
	}

	// While this node was away, gpu-0 evicted all three and stored three others.
	now := []holders.NSKey{hashKey("b1", 0), hashKey("b2", 0), hashKey("b3", 0)}
	a.keys.set(now)
	feed.Reconnected()
	for _, k := range now {
		testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, k))
	}
	for _, k := range old {
		require.Empty(t, feed.Holders(k.NS, k.Key), "evicted by gpu-0: %x", []byte(k.Key))
	}
	for _, ni := range feed.Nodes() {
		if ni.Node == "gpu-0" {
			require.Equal(t, maxKeys, ni.Keys)
			require.False(t, ni.Capped, "its whole set is indexed")
		}
	}
}

// feedAcrossServers starts gpu-2's feed on server 2 of a 3-server cluster
// and returns a connection to server 0, once the feed hears what is
// published there.
func feedAcrossServers(t *testing.T) (*nats.Conn, *Feed) {
	t.Helper()
	return feedAcrossServersWith(t, Config{Node: "gpu-2", Lease: testLease})
}

// feedAcrossServersWith is feedAcrossServers with the feed's cfg (its node
// gpu-2).
func feedAcrossServersWith(t *testing.T, cfg Config) (*nats.Conn, *Feed) {
	t.Helper()
	c := testkit.NATSCluster(t, 3)
	ncA, ncC := c.Connect(0), c.Connect(2)
	feed, err := StartFeed(ncC, cfg, slog.New(slog.DiscardHandler), nil)
	require.NoError(t, err)
	t.Cleanup(feed.Close)
	require.NoError(t, ncC.Flush())
	testkit.Eventually(t, 5*time.Second, 20*time.Millisecond, func() error {
		// Interest crosses the routes asynchronously; a probe heartbeat
		// from a throwaway node proves C's subscriptions reach s0.
		hb, _ := json.Marshal(messages.NodeHeartbeat{Node: "probe", Boot: "p"})
		_ = ncA.Publish(messages.NodeSubject("kvactors", "probe", messages.NodeVerbHeartbeat), hb)
		for _, n := range feed.Nodes() {
			if n.Node == "probe" {
				return nil
			}
		}
		return fmt.Errorf("probe heartbeat not seen by the feed")
	})
	return ncA, feed
}

// gatedKeys is a KeySource whose first page waits for the test: a
// catch-up held in flight.
type gatedKeys struct {
	keys    SortedKeys
	asked   chan struct{} // sent on at the first ask (buffered 1)
	release chan struct{}
	once    sync.Once
}

func (g *gatedKeys) KeysAfter(after holders.NSKey, max int) []holders.NSKey {
	g.once.Do(func() { g.asked <- struct{}{}; <-g.release })
	return g.keys.KeysAfter(after, max)
}

// A catch-up superseded by the node's own clear of a namespace (the
// AllBlocksCleared of its reconnect's re-announce) ends
// with holders.ErrNoSync: no failure (counted "superseded", not "error";
// logged at Debug, not Warn): the clear has the node caught up again at
// its next heartbeat, and that catch-up lists its keys.
func TestFeedCatchUpSupersededByTheNodesClearIsNoFailure(t *testing.T) {
	s := testkit.NATSServer(t)
	ncA, ncC := testkit.Connect(t, s), testkit.Connect(t, s)
	m := NewMetrics(prometheus.NewRegistry())
	var logs testkit.SyncBuffer
	feed, err := StartFeed(ncC, Config{Node: "gpu-2", Lease: testLease},
		slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})), m)
	require.NoError(t, err)
	t.Cleanup(feed.Close)
	require.NoError(t, ncC.Flush())

	held := hashKey("aa", 0)
	src := &gatedKeys{keys: NewSortedKeys([]holders.NSKey{held}), asked: make(chan struct{}, 1), release: make(chan struct{})}
	sub, err := ServeKeys(ncA, "kvactors", "gpu-0", "a1", src)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	n := &fakeNode{t: t, nc: ncA, node: "gpu-0", boot: "a1"}
	hb, _ := json.Marshal(messages.NodeHeartbeat{Node: "gpu-0", Boot: "a1", Engines: 1})
	stopBeats := testkit.Every(t, testLease/4, func() {
		_ = ncA.Publish(messages.NodeSubject("kvactors", "gpu-0", messages.NodeVerbHeartbeat), hb)
	})
	t.Cleanup(stopBeats)
	testkit.Recv(t, src.asked, 5*time.Second, "the catch-up's first page asked")

	// The node stores a key (kept through the catch-up), then clears its
	// namespace.
	stored := hashKey("bb", 0)
	n.kvEvents("e1", messages.KVEvent{Type: messages.KVBlockStored, BlockHashes: []string{"bb"}, Namespace: "m"})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, holdersOf(feed, stored))
	n.kvEvents("e1", messages.KVEvent{Type: messages.KVAllBlocksCleared, Namespace: "m"})
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if got := feed.Holders(stored.NS, stored.Key); len(got) != 0 {
			return fmt.Errorf("the clear not applied: bb held by %v", got)
		}
		return nil
	})
	close(src.release)

	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if got := testutil.ToFloat64(m.CatchUps.WithLabelValues("ok")); got < 1 {
			return fmt.Errorf("no catch-up ok yet (superseded %v, error %v)", testutil.ToFloat64(m.CatchUps.WithLabelValues("superseded")),
				testutil.ToFloat64(m.CatchUps.WithLabelValues("error")))
		}
		return nil
	})
	testkit.Eventually(t, time.Second, 10*time.Millisecond, holdersOf(feed, held)) // listed by the next catch-up
	require.Equal(t, 1.0, testutil.ToFloat64(m.CatchUps.WithLabelValues("superseded")))
	require.Zero(t, testutil.ToFloat64(m.CatchUps.WithLabelValues("error")))
	fs, _ := feed.Stats()
	require.Zero(t, fs.CatchUpFails)
	require.NotContains(t, logs.String(), "key catch-up failed")
}
