package node_test

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// kvRouter is a router as PROTOCOL.md describes one: a single subscription
// to every engine's kv_events, applying the events in the order they come.
// cpu is what it believes host memory holds, by block hash.
type kvRouter struct {
	mu     sync.Mutex
	cpu    map[string]bool
	events int
	bad    error
	log    []kvChange // every event of every medium, per hash, in order
}

// kvChange is one hash's part of one event.
type kvChange struct{ typ, medium, hash string }

func newKVRouter(t *testing.T, nc *nats.Conn) *kvRouter {
	r := &kvRouter{cpu: map[string]bool{}}
	sub, err := nc.Subscribe("kvactors.*.kv_events", func(m *nats.Msg) {
		var b messages.KVEventBatch
		err := json.Unmarshal(m.Data, &b)
		r.mu.Lock()
		defer r.mu.Unlock()
		if err != nil {
			r.bad = fmt.Errorf("kv_events %q: %w", m.Data, err)
			return
		}
		for _, ev := range b.Events {
			for _, h := range ev.BlockHashes {
				r.log = append(r.log, kvChange{ev.Type, ev.Medium, h})
			}
			if ev.Medium != messages.MediumCPU {
				continue
			}
			r.events++
			if ev.Type == messages.KVAllBlocksCleared {
				clear(r.cpu) // of one namespace, or the engine's: forgetting more is never wrong
			}
			for _, h := range ev.BlockHashes {
				switch ev.Type {
				case messages.KVBlockStored:
					r.cpu[h] = true
				case messages.KVBlockRemoved:
					delete(r.cpu, h)
				}
			}
		}
	})
	require.NoError(t, err)
	require.NoError(t, sub.SetPendingLimits(-1, -1))
	require.NoError(t, nc.Flush())
	return r
}

// Two engines of one namespace store and re-store the same few chunks
// through a pool of 3 slots, as fast as they can: every store evicts, and
// the same key is stored, evicted and stored again by different requests,
// engines and copy workers at once. A router applying the node's kv_events
// in order must end believing exactly what the pool holds: no key it
// thinks stored is missing (a BlockStored that overtook the key's
// BlockRemoved) and none the pool holds is missing from its view (a stale
// BlockRemoved after a re-store). This was PROTOCOL.md's "known gap" before
// the pool journaled its changes.
func TestKVEventsFollowThePool(t *testing.T) {
	t.Parallel()
	e := startNode(t, withPoolSlots(3))
	router := newKVRouter(t, e.nc)
	var engines []*testEngine
	for _, id := range []string{"ka", "kb"} {
		te := e.newEngine(id, defaultOpts())
		te.spec.Namespace = "shared"
		te.register()
		engines = append(engines, te)
	}
	hashes := make([]string, 8)
	for i := range hashes {
		hashes[i] = hash("order", i)
	}
	const rounds = 150
	rng := rand.New(rand.NewPCG(3, 5))
	for round := range rounds {
		for k, te := range engines {
			req := fmt.Sprintf("r%d", round)
			b := 1 + (round*2+k)%60
			te.send(added(req, 4), hashesEv(req, 0, hashes[rng.IntN(len(hashes))]), blocksEv(req, 0, 0, b),
				tokensEv(req, 4, 4), finishedEv(req, false, 4, 4))
		}
	}
	for _, te := range engines {
		for range rounds {
			recv(t, te.released, "every request released")
		}
	}
	testkit.Eventually(t, 5*time.Second, 20*time.Millisecond, func() error {
		router.mu.Lock()
		defer router.mu.Unlock()
		if router.bad != nil {
			return router.bad
		}
		for _, h := range hashes {
			held := engines[0].lookup([]string{h}) > 0
			if router.cpu[h] != held {
				return fmt.Errorf("after %d events the router believes %s held=%v, the pool says %v",
					router.events, h, router.cpu[h], held)
			}
		}
		return nil
	})
	require.Zero(t, metricValue(t, e.reg, "kvactors_kv_events_pending", nil), "nothing left in the journal")
	router.mu.Lock()
	defer router.mu.Unlock()
	require.Greater(t, router.events, 2*len(hashes), "the chunks churned through the pool")
}

// With a disk tier, a chunk evicted from host memory is written to disk by
// the disk writer's goroutine, after the decision that evicted it: its
// BlockStored DISK must reach routers after its BlockRemoved CPU (a router
// would otherwise believe the chunk left disk... or never knew it was on
// disk). Forty distinct prefixes through a 2-slot pool spill 38 of them
// (on a quiet machine).
func TestDiskStoredFollowsItsEviction(t *testing.T) {
	t.Parallel()
	e := startNode(t, withPoolSlots(2), withDisk(t.TempDir()))
	router := newKVRouter(t, e.nc)
	te := e.newEngine("d1", defaultOpts())
	te.register()
	const requests = 40
	for i := range requests {
		req := fmt.Sprintf("r%d", i)
		te.send(added(req, 4), hashesEv(req, 0, hash("spill", i)), blocksEv(req, 0, 0, 1+i%60),
			tokensEv(req, 4, 4), finishedEv(req, false, 4, 4))
	}
	for range requests {
		recv(t, te.released, "every request released")
	}
	// Every chunk stored in host memory but the pool's last two is evicted
	// and spilled. On a loaded machine a finishing request may give up on
	// a pool full of pending copies (FinishRetryLimit: the suite on two
	// cores once gave up 3), and its chunk is never stored: count what
	// was, and account for the rest as given up (the counter counts chunks:
	// one per request here). Past a quarter given up, the ordering below
	// would have too little to check: that fails too.
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		gaveUp := int(metricValue(t, e.reg, "kvactors_store_chunks_dropped_total", nil))
		router.mu.Lock()
		defer router.mu.Unlock()
		onDisk, inHost := 0, map[string]bool{}
		for _, c := range router.log {
			switch {
			case c.typ != messages.KVBlockStored:
			case c.medium == messages.MediumDisk:
				onDisk++
			default:
				inHost[c.hash] = true
			}
		}
		if gaveUp > requests/4 {
			return fmt.Errorf("%d of %d requests gave up", gaveUp, requests)
		}
		if len(inHost)+gaveUp != requests || onDisk < len(inHost)-2 {
			return fmt.Errorf("%d chunks announced on disk of %d stored in host memory (%d requests, %d given up)",
				onDisk, len(inHost), requests, gaveUp)
		}
		return nil
	})
	for _, lost := range []string{"kvactors_disk_dropped_total", "kvactors_disk_raced_total", "kvactors_disk_write_failures_total"} {
		require.Zero(t, metricValue(t, e.reg, lost, nil), lost)
	}
	router.mu.Lock()
	defer router.mu.Unlock()
	inCPU := map[string]bool{}
	for i, c := range router.log {
		switch {
		case c.medium != messages.MediumDisk:
			inCPU[c.hash] = c.typ == messages.KVBlockStored
		case c.typ == messages.KVBlockStored:
			require.False(t, inCPU[c.hash], "event %d: %s announced on disk while still in host memory", i, c.hash)
		}
	}
}

// Each pool change is announced on the engine whose operation made it when
// that engine is in the key's namespace: two engines of one namespace on
// one node, a pool of one slot, each store evicting the other's chunk. An
// engine's kv_events carry its own stores and the evictions its stores
// caused, and nothing of the other's.
func TestKVEventsGoToTheEngineThatMadeTheChange(t *testing.T) {
	t.Parallel()
	e := startNode(t, withPoolSlots(1))
	ka, kb := e.newEngine("ka", defaultOpts()), e.newEngine("kb", defaultOpts())
	for _, te := range []*testEngine{ka, kb} {
		te.spec.Namespace = "shared"
		te.register()
	}
	store := func(te *testEngine, req, h string) {
		te.send(added(req, 4), hashesEv(req, 0, h), blocksEv(req, 0, 0, 1), tokensEv(req, 4, 4))
		recv(t, te.stored, req+" stored")
	}
	k1, k2, k3 := hash("own", 1), hash("own", 2), hash("own", 3)
	store(ka, "a1", k1)
	store(kb, "b1", k2) // evicts k1
	store(ka, "a2", k3) // evicts k2
	// changes reads te's kv_events until the BlockStored of last.
	changes := func(te *testEngine, last string) []string {
		var got []string
		for {
			b := recv(t, te.kv, te.id+"'s kv_events")
			for _, ev := range b.Events {
				require.Equal(t, "shared", ev.Namespace)
				for _, h := range ev.BlockHashes {
					got = append(got, ev.Type+" "+h)
				}
			}
			if got[len(got)-1] == messages.KVBlockStored+" "+last {
				return got
			}
		}
	}
	require.Equal(t, []string{messages.KVBlockStored + " " + k1, messages.KVBlockRemoved + " " + k2,
		messages.KVBlockStored + " " + k3}, changes(ka, k3))
	require.Equal(t, []string{messages.KVBlockRemoved + " " + k1, messages.KVBlockStored + " " + k2}, changes(kb, k2))
}
