package node_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/cluster/ownership"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// gatedDevice counts every device copy of its node and, while the gate's
// hold is set, holds each one until the test lets it go.
type gatedDevice struct {
	backend.Attachment
	g *deviceGate
}

type deviceGate struct {
	hold    atomic.Bool
	copies  atomic.Int64  // copies started, held or not
	ended   atomic.Int64  // when the last copy returned (unix nanos)
	started chan struct{} // one per held copy
	gate    chan struct{} // one lets one held copy go
}

func (g *deviceGate) wrap(a backend.Attachment) backend.Attachment { return &gatedDevice{a, g} }

func (d *gatedDevice) Copy(dir backend.Direction, a backend.Arena, r []backend.Range) error {
	d.g.copies.Add(1)
	if d.g.hold.Load() {
		d.g.started <- struct{}{}
		<-d.g.gate
	}
	err := d.Attachment.Copy(dir, a, r)
	d.g.ended.Store(time.Now().UnixNano())
	return err
}

// docs/CLUSTER.md failure table, "owner killed (kill -9) or partitioned"
// and "the old owner comes back (pause, partition heals)", with nodes:
// nA owns engine e1 and reaches NATS only through a link; nB runs
// --standby-for nA on another server; e1 (the Go SDK) names nA. With r2's
// store copy held in nA's device and r3's queued behind it (one worker),
// nA's link is cut. nA fences (PROTOCOL.md "Fencing"): the held copy,
// let go once nA is fenced, ends before 5/8 lease (no fail-stop) and
// long before e1 can take nA for lost; r3's copy never starts (lapse).
// nA's record lapses, nB takes e1 over, e1 resyncs with it, and every
// request is released exactly once. Then the link heals: nA's claim fails
// its CAS against nB's revision (its release, or its keep-alive: ErrFenced)
// and nA holds none, the record stays nB's, e1's heartbeat and register are
// answered by nB alone, and nA copies nothing more: e1's blocks are as they
// were at the cut.
func TestPartitionedOwnerIsTakenOverByItsStandbyAndFencedWhenTheLinkHeals(t *testing.T) { // not parallel: a copy must end within lease/8 of the fence, and the link's port is reused
	began := time.Now()
	dev := &deviceGate{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
	var failStops atomic.Int64
	kc := &kvCluster{t: t, nats: testkit.NATSCluster(t, 3), dir: t.TempDir()}
	link := testkit.NewLink(t, strings.TrimPrefix(kc.nats.URL(0), "nats://"))
	nA := kc.startNode(0, "nA", func(_ int, c *node.Config) {
		c.NATSURL = "nats://" + link.Addr
		node.WithNATSOptions(nats.IgnoreDiscoveredServers())(c) // cut off, not failed over
		c.WrapDevice = dev.wrap
		c.Transfer.Workers = 1 // r3's copy queues behind r2's held one
		c.FailStop = func(string) { failStops.Add(1) }
	})
	nB := kc.startNode(1, "nB", func(_ int, c *node.Config) { c.StandbyFor = "nA" })
	kc.nodes = []*env{nA, nB}
	t.Cleanup(func() { close(dev.gate) }) // before the nodes' Close: no copy left held
	kc.waitSeen()

	te := nA.newEngine("e1", defaultOpts()) // its segment and blocks; the SDK speaks for it
	te.spec.Node = "nA"
	for b := messages.BlockID(1); b <= 5; b++ {
		te.fill(0, b, 1)
	}
	stored := make(chan messages.Stored, 16)
	c, releases := sdkEngine(t, kc.nats.URLs(2), "e1", te.spec, func(s messages.Stored) { stored <- s })
	require.Equal(t, "nA", c.Stats().Node)
	send := func(req string, blocks ...uint32) {
		t.Helper()
		n := 4 * len(blocks)
		require.NoError(t, c.Added(req, n))
		hs := make([][]byte, len(blocks))
		for i := range hs {
			hs[i] = []byte(fmt.Sprintf("%s-%d", req, i))
		}
		require.NoError(t, c.Hashes(req, 0, hs...))
		require.NoError(t, c.Blocks(req, 0, 0, blocks))
		require.NoError(t, c.Tokens(req, n, n))
	}
	finish := func(req string, tokens int) { t.Helper(); require.NoError(t, c.Finished(req, false, tokens, tokens)) }

	// r1 is stored on nA and released before anything fails.
	send("r1", 1, 2)
	finish("r1", 8)
	require.NoError(t, c.Flush())
	require.Equal(t, "r1", testkit.Recv(t, stored, 5*time.Second, "r1 stored on nA").Request)
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if len(releases()["r1"]) == 0 {
			return errors.New("r1 not released by nA")
		}
		return nil
	})

	// r2's copy is held in nA's device, r3's queued behind it.
	dev.hold.Store(true)
	send("r2", 3)
	finish("r2", 4)
	require.NoError(t, c.Flush())
	testkit.Recv(t, dev.started, 5*time.Second, "r2's store copy held on nA")
	send("r3", 4)
	require.NoError(t, c.Flush())
	awaitRequestRead(t, nA, "e1", "r3")
	copies := dev.copies.Load()

	// The partition.
	link.Cut()
	cut := time.Now()
	atCut := bytes.Clone(te.seg.Bytes())
	awaitFenced(t, nA.node, clusterLease)
	dev.gate <- struct{}{} // r2's copy ends now, under 5/8 lease after nA's last round trip
	testkit.Eventually(t, clusterLease, 5*time.Millisecond, func() error {
		if dev.ended.Load() == 0 {
			return errors.New("r2's copy has not ended")
		}
		if v := nA.counter("kvactors_transfer_copies_lapsed_total", ""); v < 1 {
			return errors.New("r3's copy not refused by nA's fence yet")
		}
		return nil
	})
	copyEnded := time.Unix(0, dev.ended.Load())
	require.Less(t, copyEnded.Sub(cut), clusterLease*5/8, "r2's copy ended past 5/8 lease after the cut")

	// nB takes e1 over once nA's record lapsed; e1 resyncs with nB.
	testkit.Eventually(t, 4*clusterLease, 5*time.Millisecond, func() error {
		if st := c.Stats(); st.Node != "nB" || !c.Live() {
			return fmt.Errorf("e1 not taken over: registered with %s, live %v, nB serves %v", st.Node, c.Live(), nB.node.Engines())
		}
		return nil
	})
	takeover := time.Now()
	require.GreaterOrEqual(t, takeover.Sub(cut), clusterLease*3/4, "taken over before e1 could take nA for lost")
	require.True(t, copyEnded.Before(takeover))
	require.Equal(t, []string{"e1"}, nB.node.Engines())
	require.Empty(t, nA.node.Engines(), "nA, cut off, stopped serving e1")
	require.Equal(t, copies, dev.copies.Load(), "nA started a copy after the cut")
	require.Zero(t, failStops.Load(), "a fail-stop: no copy ran past 5/8 lease")

	// r3 (re-announced by the resync) and a new r4 finish on nB.
	require.NoError(t, c.Finished("r3", false, 4, 4))
	send("r4", 5)
	finish("r4", 4)
	require.NoError(t, c.Flush())
	got := map[string]bool{}
	testkit.Eventually(t, 2*clusterLease, 5*time.Millisecond, func() error {
		for {
			select {
			case s := <-stored:
				got[s.Request] = true
				continue
			default:
			}
			break
		}
		if !got["r3"] || !got["r4"] {
			return fmt.Errorf("stored on nB so far: %v", got)
		}
		return nil
	})

	// The link heals. nA expired e1 during the partition (silent for a
	// lease) and gives its claim up now: its conditional delete, or its
	// keep-alive if that runs first (ErrFenced, counted), fails its CAS
	// against nB's revision. Either way nA holds no claim, the record
	// stays nB's, and nA serves nothing of e1.
	fenced := nA.counter("kvactors_cluster_ownership_fenced_total", "")
	link.Restore()
	testkit.Eventually(t, 2*clusterLease, 5*time.Millisecond, func() error {
		if err := nA.node.Ready(); err != nil {
			return fmt.Errorf("nA not back on NATS: %w", err)
		}
		if got := nA.node.Claims(); len(got) != 0 {
			return fmt.Errorf("nA still claims %v", got)
		}
		return nil
	})
	bucket := ownersBucket(t, nB.nc)
	ownedByB := func() {
		t.Helper()
		e, err := bucket.Get(context.Background(), "e1")
		require.NoError(t, err)
		r, err := ownership.DecodeRecord(e.Value())
		require.NoError(t, err)
		require.Equal(t, ownership.Identity{Node: "nB", Boot: nB.node.Boot()}, r.Identity)
	}
	ownedByB()
	require.Empty(t, nA.node.Engines(), "nA serves e1 again")
	require.Equal(t, []string{"e1"}, nB.node.Engines())

	stamped := make(chan string, 64) // e1's kv_events, by publishing node
	sub, err := nB.nc.Subscribe("kvactors.e1."+messages.VerbKVEvents, func(m *nats.Msg) {
		stamped <- m.Header.Get(messages.HeaderNode)
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	ignored := decisions(nA, "ignore")
	beats := collect(t, nB.nc, "kvactors.e1.heartbeat", messages.HeartbeatRequest{Epoch: c.Epoch()})
	var rep messages.HeartbeatReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, beats, 2*time.Second, "the heartbeat's answer").Data, &rep))
	require.Equal(t, "nB", rep.Node, "heartbeat answered by %s: %+v", rep.Node, rep)
	testkit.NoRecv(t, beats, 300*time.Millisecond, "a second heartbeat answer (nA's)")
	testkit.Eventually(t, clusterLease, 5*time.Millisecond, func() error {
		if decisions(nA, "ignore") == ignored {
			return errors.New("nA has not decided e1's heartbeat")
		}
		return nil
	})

	// Quiet for a lease: every request was released once, none twice.
	window := time.After(clusterLease)
	for quiet := false; !quiet; {
		select {
		case from := <-stamped:
			require.NotEqual(t, "nA", from, "nA published e1's kv_events after the heal")
		case <-window:
			quiet = true
		}
	}
	// r2's release by nA (its copy ended in the partition) and r3's reset
	// reached e1 only at the heal, for the epoch it had left: stale. r2 was
	// freed as its node was lost, r3 finished on nB.
	rel := releases()
	want := map[string]string{"r1": messages.ReasonFinished, "r2": messages.ReasonNodeLost,
		"r3": messages.ReasonFinished, "r4": messages.ReasonFinished}
	for r, reason := range want {
		require.Len(t, rel[r], 1, "releases of %s: %+v", r, rel[r])
		require.Equal(t, reason, rel[r][0].Reason, "release of %s", r)
	}
	require.Len(t, rel, len(want), "releases: %+v", rel)
	require.Zero(t, c.Stats().UnexpectedRel)
	require.Equal(t, 2, c.Stats().StaleReleases, "nA's releases of r2 and r3, held in the partition")
	ownedByB() // a lease after the heal: no keep-alive of nA's took it back
	require.Empty(t, nA.node.Claims())

	// A register naming nA is served by nB alone (its standby, docs/CLUSTER.md
	// Decide); nA ignores it, naming the owner.
	ignored = decisions(nA, "ignore")
	regs := collect(t, nB.nc, "kvactors.e1.register", te.spec)
	var rr messages.RegisterReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, regs, 2*time.Second, "the register's answer").Data, &rr))
	require.True(t, rr.OK, rr.Error)
	require.Equal(t, "nB", rr.Node)
	testkit.NoRecv(t, regs, 300*time.Millisecond, "a second register answer (nA's)")
	require.Greater(t, decisions(nA, "ignore"), ignored, "nA did not decide the register")
	require.Equal(t, []string{"e1"}, nB.node.Engines())
	require.Empty(t, nA.node.Engines())

	require.Equal(t, copies, dev.copies.Load(), "nA started a copy after the cut")
	require.True(t, bytes.Equal(atCut, te.seg.Bytes()), "e1's blocks changed after the cut")
	require.Zero(t, failStops.Load())
	t.Logf("cut→copy end %v, cut→takeover %v, keep-alives fenced at the heal %v, stale releases %d, total %v",
		copyEnded.Sub(cut), takeover.Sub(cut), nA.counter("kvactors_cluster_ownership_fenced_total", "")-fenced,
		c.Stats().StaleReleases, time.Since(began))
}

// nodeStatus asks e's node (through its own connection) for engine's status.
func nodeStatus(e *env, engine string) (node.StatusReply, error) {
	var st node.StatusReply
	m, err := testkit.EngineRequest(e.nc, engine, "kvactors."+engine+".status", []byte(`{}`), time.Second)
	if err != nil {
		return st, err
	}
	if err := json.Unmarshal(m.Data, &st); err != nil {
		return st, err
	}
	if st.Error != "" {
		return st, errors.New(st.Error)
	}
	return st, nil
}

// awaitRequestRead waits until e's node lists req among engine's live
// requests (its status): the node has read the events that added it.
func awaitRequestRead(t *testing.T, e *env, engine, req string) {
	t.Helper()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		st, err := nodeStatus(e, engine)
		if err != nil {
			return err
		}
		for _, r := range st.Requests {
			if r.Request == req {
				return nil
			}
		}
		return fmt.Errorf("the node has not read %s of %s yet (requests %+v)", req, engine, st.Requests)
	})
}

// sdkEngine connects the Go SDK on urls as engine id with spec (no log),
// onStored (nil: none) given each stored; releases returns a copy of every
// release delivered so far, by request.
func sdkEngine(t *testing.T, urls, id string, spec messages.EngineSpec,
	onStored func(messages.Stored)) (c *client.Client, releases func() map[string][]client.Release) {
	t.Helper()
	var mu sync.Mutex
	got := map[string][]client.Release{}
	enc, err := nats.Connect(urls, client.Options(id)...)
	require.NoError(t, err)
	t.Cleanup(enc.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err = client.Connect(ctx, enc, client.Config{Engine: id, Spec: spec, RequestTimeout: time.Second,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), OnStored: onStored,
		OnReleased: func(r client.Release) { mu.Lock(); got[r.Request] = append(got[r.Request], r); mu.Unlock() }})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c, func() map[string][]client.Release {
		mu.Lock()
		defer mu.Unlock()
		copied := make(map[string][]client.Release, len(got))
		for r, rs := range got {
			copied[r] = append([]client.Release(nil), rs...)
		}
		return copied
	}
}
