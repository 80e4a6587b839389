package node

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// heldElsewhere: a live node of the cluster other than this one holds pool
// key k of namespace ns (other nodes know it by its wire key).
func (n *Node) heldElsewhere(ns string, k messages.Key) bool {
	return n.cl != nil && len(n.cl.feed.Holders(ns, sched.WireKey(k))) > 0
}

// remoteKeys are the keys of a load that this pool does not hold ready and
// another node does (in the engine's namespace), deduplicated.
func (n *Node) remoteKeys(engine string, keys []messages.Key) []messages.Key {
	if n.cl == nil {
		return nil
	}
	pool, ns := n.sharedPool(), n.engineNamespace(engine)
	var out []messages.Key
	seen := map[messages.Key]bool{}
	for _, k := range keys {
		if seen[k] {
			continue
		}
		seen[k] = true
		if st, _ := pool.Lookup(k); st != hostpool.Ready && n.heldElsewhere(ns, k) {
			out = append(out, k)
		}
	}
	return out
}

// fetchParallel bounds the chunks of one load fetched at once.
const fetchParallel = 4

// fetchRemote stores keys in the local pool from the nodes that hold them:
// slots are reserved (PrepareStore), each chunk is fetched straight into its
// slot and verified (CRC-32C), and only verified chunks become ready. It
// returns how many chunks it fetched; any failure fails the load (the error
// names the key), and bytes that failed verification are never made ready,
// so never copied to a device.
func (n *Node) fetchRemote(ctx context.Context, engine string, keys []messages.Key) (int, error) {
	pool, sb, ns := n.sharedPool(), n.slotBytesNow(), n.engineNamespace(engine)
	prep, err := pool.PrepareStore(keys)
	if err != nil {
		return 0, fmt.Errorf("room for %d remote chunks: %w", len(keys), err)
	}
	n.announceEvicted(prep.Evicted)
	arena := n.arena.Bytes()
	errs := make([]error, len(prep.Keys))
	sem := make(chan struct{}, fetchParallel)
	var wg sync.WaitGroup
	for i, k := range prep.Keys {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			off := int64(prep.Slots[i]) * sb
			alloc := func(size int64) ([]byte, error) {
				if size > sb {
					return nil, fmt.Errorf("chunk of %d bytes exceeds the pool slot of %d bytes", size, sb)
				}
				return arena[off : off+size], nil
			}
			fctx, cancel := context.WithTimeout(ctx, n.cl.cfg.FetchTimeout*4)
			defer cancel()
			wk := sched.WireKey(k)
			_, _, err := n.cl.fetcher.FetchAny(fctx, n.cl.feed.Holders(ns, wk), ns, wk, alloc)
			pool.CompleteStore([]messages.Key{k}, err == nil)
			errs[i] = err
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	// Keys PrepareStore left out were already present: ready, or pending
	// because another load (or a store) is filling them. Wait for those,
	// as long as a fetch may take, so that two loads of one remote prefix
	// at once both succeed.
	if len(prep.Keys) < len(keys) {
		waitSettled(ctx, pool, keys, time.Now().Add(n.cl.cfg.FetchTimeout*4))
	}
	return len(prep.Keys), nil
}

// settlePoll is how often waitSettled looks at the pool.
const settlePoll = 2 * time.Millisecond

// waitSettled returns once no key is pending in pool, at deadline, or when
// ctx ends (the load then finds a key not ready and fails as a miss).
func waitSettled(ctx context.Context, pool *hostpool.Shared, keys []messages.Key, deadline time.Time) {
	t := time.NewTicker(settlePoll)
	defer t.Stop()
	for {
		pending := false
		for _, k := range keys {
			if st, _ := pool.Lookup(k); st == hostpool.Pending {
				pending = true
				break
			}
		}
		if !pending || time.Now().After(deadline) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
