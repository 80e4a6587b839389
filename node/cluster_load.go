package node

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// heldElsewhere: a live node of the cluster other than this one holds pool
// key k of namespace ns (other nodes know it by its wire key).
func (n *Node) heldElsewhere(ns string, k messages.Key) bool {
	return n.cl != nil && len(n.cl.feed.Holders(ns, sched.WireKey(k))) > 0
}

// remoteKeys are the keys of a load that this node's store cannot load
// (not in host memory or on disk, or there of another size than the
// engine's chunk: Engine.Ready) and another node holds (in the engine's
// namespace), deduplicated.
func (n *Node) remoteKeys(rec *engineRec, keys []messages.Key) []messages.Key {
	if n.cl == nil {
		return nil
	}
	ns := rec.clusterNamespace()
	var out []messages.Key
	seen := map[messages.Key]bool{}
	for _, k := range keys {
		if seen[k] {
			continue
		}
		seen[k] = true
		if !rec.store.Ready(k) && n.heldElsewhere(ns, k) { // as lookup counts it
			out = append(out, k)
		}
	}
	return out
}

// fetchParallel bounds the chunks of one load fetched at once.
const fetchParallel = 4

// fetchRemote stores keys in this node's store from the nodes that hold
// them: room is made as for a store (the engine's PrepareStore: evictions
// are announced, and spilled to disk when there is a disk tier), each chunk
// is fetched (its CRC-32C checked over the whole chunk), written into its
// room and checked again there, and only then made ready, pinned
// (store.FillRemote). loadKeys are all the load's keys: those ready in host
// memory are pinned before any room is made, and those pending (their
// copy running) as their copy makes them ready (store.PinLocal), so
// neither that room nor another engine's store during the fetch's round
// trips evicts the load's own local chunks, which would fail it as a miss
// after the fetch. It returns the pins: the local ones, the keys it
// fetched (each once per pin), and how many it fetched; the load lets go
// of them once its own pins hold them or it ends without them
// (loadStart.fetchPins, localPins). Any failure fails the load with the
// error naming the key, frees that key's room, and no byte of it is ever
// loadable, and every pin it took is let go of (the chunks stay, as any
// stored chunk).
func (n *Node) fetchRemote(ctx context.Context, rec *engineRec, keys, loadKeys []messages.Key) (*hostpool.Pins, []messages.Key, int, error) {
	// Close cancels the fetches, then waits for this one: the pool it
	// writes into is unmapped next.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(n.cl.closing, cancel)()
	ns := rec.clusterNamespace()
	// Each key is pinned in one step with its lookup: one evicted (by
	// another engine) since remoteKeys looked it up is absent, not pinned,
	// and the load finds it missing, as it would have. One pending (another
	// copy is filling it) is pinned in the step that copy makes it ready
	// (if it fails, the key is absent and the load misses it); one still
	// pending when the fetch ends, the load waits for (startLoad). A remote
	// key another load made ready meanwhile is pinned here and not fetched
	// (PrepareStore gives it no room).
	local := n.store.PinLocal(loadKeys)
	var pinned []messages.Key // fetched, pinned by FillRemote
	handed := false
	defer func() {
		if !handed { // failed or cancelled: the load gets none of the pins
			n.store.Unpin(local)
			n.store.UnpinRemote(pinned)
		}
	}()
	sizes := make([]int64, len(keys))
	for i, k := range keys {
		_, _, g := sched.SplitKey(k)
		if g < 0 || g >= len(rec.layout.Groups) {
			return nil, nil, 0, fmt.Errorf("key %x: group %d not in the engine's layout", []byte(sched.WireKey(k)), g)
		}
		sizes[i] = rec.layout.Groups[g].ChunkBytes
	}
	// Only the remote keys are offered: the load's local ones are pinned,
	// so the room is never made by evicting them (and a pending one is no
	// eviction's to take).
	prep, err := rec.store.PrepareStore(keys, sizes) // evictions and fills are journaled (kvJournal)
	n.metrics.Evictions.Add(float64(len(prep.Evicted)))
	if err != nil {
		return nil, nil, 0, fmt.Errorf("room for %d remote chunks: %w", len(keys), err)
	}
	fetch := prep.Keys
	// The first chunk that fails fails the load: the fetches still to come
	// or running are cancelled, not waited out (a holder that does not
	// answer would cost a piece timeout per four chunks), and the reply
	// names that failure and how many more there were, not every one (a
	// load of thousands of chunks would pass max_payload and go unanswered).
	fetchCtx, cancelAll := context.WithCancel(ctx)
	defer cancelAll()
	var failMu sync.Mutex
	var firstErr error
	failed, fetched := 0, 0
	fail := func(err error) {
		failMu.Lock()
		defer failMu.Unlock()
		failed++
		if firstErr == nil {
			firstErr = err
			cancelAll()
		}
	}
	sem := make(chan struct{}, fetchParallel)
	var wg sync.WaitGroup
	for _, k := range fetch {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			if fetchCtx.Err() != nil { // an earlier chunk failed the load
				n.store.AbortRemote([]messages.Key{k})
				return
			}
			fctx, cancel := context.WithTimeout(fetchCtx, n.cl.cfg.FetchTimeout*4)
			defer cancel()
			wk := sched.WireKey(k)
			data, _, err := n.cl.fetcher.FetchAny(fctx, n.cl.feed.Holders(ns, wk), ns, wk, func(size int64) ([]byte, error) {
				if f := n.cl.inGate.Load(); f != nil {
					(*f)("fetch")
				}
				if _, want := n.store.Lookup(k); size != want {
					return nil, fmt.Errorf("chunk of %d bytes, %d in this engine's layout", size, want)
				}
				return make([]byte, size), nil
			})
			if err != nil {
				n.store.AbortRemote([]messages.Key{k})
			} else if err = n.store.FillRemote(rec.id, k, data, cluster.CRC32C(data)); err == nil {
				failMu.Lock()
				pinned = append(pinned, k) // pinned by FillRemote
				fetched++
				failMu.Unlock()
			}
			if err != nil && (fetchCtx.Err() == nil || !errors.Is(err, context.Canceled)) {
				fail(err)
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		if failed > 1 {
			return nil, nil, 0, fmt.Errorf("%w (and %d more chunks of the load failed)", firstErr, failed-1)
		}
		return nil, nil, 0, firstErr
	}
	if err := ctx.Err(); err != nil { // cancelled from outside: no failure of its own recorded
		return nil, nil, 0, err
	}
	// Keys PrepareStore left out were already present: ready, or pending
	// because another load (or a store) is filling them. The load waits for
	// those as any load does (startLoad, waitLoad), so two loads of one
	// remote prefix at once both succeed.
	handed = true
	return local, pinned, fetched, nil
}
