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
}

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
			if ev.Medium != messages.MediumCPU {
				continue
			}
			r.events++
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
	router.mu.Lock()
	defer router.mu.Unlock()
	require.Greater(t, router.events, 2*len(hashes), "the chunks churned through the pool")
}
