package node

import (
	"context"
	"errors"
	"fmt"
	"sync"

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
	return len(prep.Keys), nil
}
