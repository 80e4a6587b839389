package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// killLease is the cluster lease of the kill test (at least 1 s).
const killLease = time.Second

// engineSpec is a one-group engine on a fresh shm segment in dir: 64 blocks
// of 256 bytes, 4 tokens per block and per hash, one block per chunk.
func engineSpec(t *testing.T, dir, id, nodeID string) (messages.EngineSpec, *shm.Segment) {
	seg, err := shm.Create(dir, id+"-seg", 64*256)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Remove() })
	return messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 64, Node: nodeID,
		Segments: []messages.Segment{{Shm: seg.Name()}},
		Groups: []messages.GroupSpec{{Kind: "full", TokensPerBlock: 4,
			Regions: []messages.Region{{Segment: 0, Offset: 0, BlockStride: 256, BlockBytes: 256}}}}}, seg
}

// releases counts every release an engine receives, per request.
type releases struct {
	mu  sync.Mutex
	got map[string][]string // request → reasons
}

func (r *releases) add(rel client.Release) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got[rel.Request] = append(r.got[rel.Request], rel.Reason)
}

func (r *releases) of(req string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.got[req]...)
}

// kill -9 of a clustered node (a real child process): its keys stop
// counting on the other nodes within the lease, its standby takes its
// engines over once the ownership lease lapses, the engines see the new
// boot and resync, and every request is released exactly once: one
// finished before the kill by its node, one finished while the node was
// stopped (never read) by the engine as node_lost, one live across the
// kill by the standby; then a lease of quiet.
func TestClusterKilledNodeIsTakenOverByItsStandby(t *testing.T) { killAndTakeOver(t) }

func killAndTakeOver(t *testing.T) {
	nc3 := testkit.NATSCluster(t, 3)
	dir := t.TempDir()
	lease := killLease.String()

	// Node nA: a child process on server 0, killed below.
	a := exec.Command(binary, "serve", "--nats", nc3.URLs(0), "--cluster", "--cluster-replicas", "3",
		"--node-id", "nA", "--lease", lease, "--shm-dir", dir, "--pool-bytes", "1M", "--http", "off",
		"--log-level", "warn")
	a.Stdout, a.Stderr = io.Discard, os.Stderr
	require.NoError(t, a.Start())
	t.Cleanup(func() { _ = a.Process.Kill(); _ = a.Wait() })

	// Node nB stands by for nA, in process, on server 1.
	b, err := node.Start(context.Background(), node.Config{NATSURL: nc3.URLs(1), NodeID: "nB", StandbyFor: "nA",
		ClusterReplicas: 3, Lease: killLease, ShmDir: dir, PoolBytes: 1 << 20, HTTPAddr: node.HTTPOff,
		Registry: prometheus.NewRegistry(), Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	live := func(id string) bool {
		for _, ni := range b.ClusterNodes() {
			if ni.Node == id {
				return ni.Live
			}
		}
		return false
	}
	// Until nB has heard nA it would take nA's engines itself.
	testkit.Eventually(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !live("nA") {
			return fmt.Errorf("nB has not heard nA yet")
		}
		return nil
	})

	type eng struct {
		c   *client.Client
		seg *shm.Segment
		rel *releases
	}
	engines := map[string]*eng{}
	for i, id := range []string{"e1", "e2"} {
		spec, seg := engineSpec(t, dir, id, "nA")
		spec.Namespace = "m"
		enc, err := nats.Connect(nc3.URLs(2-i), client.Options(id)...)
		require.NoError(t, err)
		t.Cleanup(enc.Close)
		rel := &releases{got: map[string][]string{}}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		// A register nobody answers (before the record lapses) waits out
		// the request timeout: short, so the takeover is seen soon after.
		c, err := client.Connect(ctx, enc, client.Config{Engine: id, Spec: spec, OnReleased: rel.add,
			RequestTimeout: 300 * time.Millisecond,
			Log:            slog.New(slog.NewTextHandler(io.Discard, nil))})
		cancel()
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		require.Equal(t, "nA", c.Stats().Node, "the named node answers")
		engines[id] = &eng{c: c, seg: seg, rel: rel}
	}
	hashes := func(req string) ([][]byte, []string) {
		var raw [][]byte
		var hx []string
		for i := range 4 {
			h := []byte(fmt.Sprintf("%s/%d", req, i))
			raw, hx = append(raw, h), append(hx, hex.EncodeToString(h))
		}
		return raw, hx
	}
	start := func(e *eng, req string, first uint32) {
		raw, _ := hashes(req)
		e.c.Added(req, 16)
		e.c.Hashes(req, 0, raw...)
		e.c.Blocks(req, 0, 0, []uint32{first, first + 1, first + 2, first + 3})
		e.c.Tokens(req, 16, 16)
		require.NoError(t, e.c.Flush())
	}
	// r1 of each engine: stored, finished and released by nA. r2: live
	// across the kill, finished after the takeover.
	for id, e := range engines {
		start(e, id+"-r1", 10)
		_, hx := hashes(id + "-r1")
		testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
			got, err := e.c.Lookup(context.Background(), hx)
			if err != nil || got != 16 {
				return fmt.Errorf("lookup on nA: %d, %v", got, err)
			}
			return nil
		})
		e.c.Finished(id+"-r1", false, 16, 16)
		require.NoError(t, e.c.Flush())
		start(e, id+"-r2", 20)
		start(e, id+"-r3", 30)
	}
	for id, e := range engines {
		testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
			if got := e.rel.of(id + "-r1"); len(got) != 1 {
				return fmt.Errorf("%s-r1 releases: %v", id, got)
			}
			return nil
		})
	}
	// nB counts nA's keys before the kill.
	_, hx1 := hashes("e1-r1")
	aBoot := engines["e1"].c.Stats().Boot

	// r3 finishes while nA is stopped, so nA never reads it: it is owed a
	// release at the kill, which only the engine can give (node_lost, once
	// a lease has passed); nB, taking over, must not release it again.
	require.NoError(t, a.Process.Signal(syscall.SIGSTOP))
	for id, e := range engines {
		e.c.Finished(id+"-r3", false, 16, 16)
		require.NoError(t, e.c.Flush())
	}
	require.NoError(t, a.Process.Signal(syscall.SIGKILL))
	killed := time.Now()
	_ = a.Wait()

	// nA's keys stop counting: nB drops nA within the lease (plus one
	// heartbeat period of slack for the last heartbeat's age).
	testkit.Eventually(t, 2*killLease, 10*time.Millisecond, func() error {
		if live("nA") {
			return fmt.Errorf("nA still live on nB")
		}
		return nil
	})
	gone := time.Since(killed)
	require.LessOrEqual(t, gone, killLease+killLease/4+200*time.Millisecond, "nA stopped counting within the lease")
	t.Logf("nA stopped counting as a holder %v after the kill", gone)

	// The engines lose nA, free what awaited a release after the lease,
	// register again naming nA, and nB (standby, nA not live, record
	// lapsed) takes them over with its own boot; they resync.
	for id, e := range engines {
		testkit.Eventually(t, 15*time.Second, 20*time.Millisecond, func() error {
			st := e.c.Stats()
			if st.Node != "nB" || st.Resyncs["new_boot"] == 0 {
				return fmt.Errorf("%s: node %s/%s, resyncs %v", id, st.Node, st.Boot, st.Resyncs)
			}
			return nil
		})
		require.NotEqual(t, aBoot, e.c.Stats().Boot)
	}
	took := time.Since(killed)
	t.Logf("standby took both engines over %v after the kill", took)
	require.ElementsMatch(t, []string{"e1", "e2"}, b.Engines())

	// nA's keys no longer count; the resynced r2 finishes on nB and is
	// released once.
	got, err := engines["e1"].c.Lookup(context.Background(), hx1)
	require.NoError(t, err)
	require.Zero(t, got, "the dead node's chunks are not counted")
	for id, e := range engines {
		e.c.Finished(id+"-r2", false, 16, 16)
		require.NoError(t, e.c.Flush())
	}
	for id, e := range engines {
		testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
			for _, r := range []string{id + "-r2", id + "-r3"} {
				if got := e.rel.of(r); len(got) != 1 {
					return fmt.Errorf("%s releases: %v", r, got)
				}
			}
			return nil
		})
	}
	// Nothing more arrives: a lookup round trip with nB (answered once it
	// has handled all the engine sent before), then a lease of quiet, in
	// which a second release of any request fails the test.
	for _, e := range engines {
		_, err := e.c.Lookup(context.Background(), hx1)
		require.NoError(t, err)
	}
	quiet := time.After(killLease)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for waiting := true; waiting; {
		for id, e := range engines {
			for _, r := range []string{id + "-r1", id + "-r2", id + "-r3"} {
				require.Len(t, e.rel.of(r), 1, "%s released exactly once: %v", r, e.rel.of(r))
			}
			require.Equal(t, []string{messages.ReasonNodeLost}, e.rel.of(id+"-r3"), "%s-r3: freed by the engine", id)
		}
		select {
		case <-tick.C:
		case <-quiet:
			waiting = false
		}
	}
	for id, e := range engines {
		st := e.c.Stats()
		require.Zero(t, st.Live, "%s: no live request left", id)
		require.Zero(t, st.UnexpectedRel, "%s: no release for a request not waiting for one", id)
		for _, r := range []string{id + "-r1", id + "-r2", id + "-r3"} {
			require.Len(t, e.rel.of(r), 1, "%s released exactly once: %v", r, e.rel.of(r))
		}
	}
	js, _ := json.Marshal(engines["e1"].c.Stats())
	t.Logf("e1 stats: %s", js)
}
