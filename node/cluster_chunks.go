package node

// A node's side of the cluster's chunk sharing: the chunks it serves to
// other nodes' fetches (readChunk, with a small cache for a fetch's
// pieces) and the set of keys it has announced (heldKeys), which is what
// it serves from and what peers catch up on.

import (
	"encoding/binary"
	"fmt"
	"sync"
	"time"

	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/cluster/holders"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// readChunk serves a chunk of host memory to another node's fetch: its
// bytes and the CRC-32C the store took when the chunk was copied from the
// device, after the store checked the bytes against it (store.ReadChunk;
// a corrupt chunk is dropped and announced, never served). A fetch asks
// piece by piece, so the last few chunks read are kept while their key stays
// ready, for a fetch timeout (recentChunksCache): a 4 MiB chunk is copied
// and checked once per fetch, not once per piece.
func (n *Node) readChunk(ns string, wk messages.Key) ([]byte, uint32, error) {
	if !n.cl.reads.enter() {
		return nil, 0, fmt.Errorf("%w: node closing", cluster.ErrNoChunk)
	}
	defer n.cl.reads.leave()
	if f := n.cl.inGate.Load(); f != nil {
		(*f)("read")
	}
	// ns is the requester's namespace with its geometry
	// (messages.ClusterNamespace): a key names the same bytes only under
	// the same geometry, and this node's namespace may have another (each
	// node fixes it for its own boot). A request without one (a node of an
	// older version) is refused: it cannot be told to match.
	nsKey, geo, ok := messages.SplitClusterNamespace(ns)
	if !ok {
		return nil, 0, fmt.Errorf("%w: namespace %q names no geometry", cluster.ErrNoChunk, ns)
	}
	if !n.cl.keys.has(ns, wk) {
		return nil, 0, fmt.Errorf("%w: %s/%x", cluster.ErrNoChunk, ns, []byte(wk))
	}
	key, err := n.poolKey(nsKey, geo, wk)
	if err != nil {
		return nil, 0, fmt.Errorf("%w: %w", cluster.ErrNoChunk, err)
	}
	c := &n.cl.recent
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	if st, _ := n.store.Lookup(key); st == hostpool.Ready {
		if e, ok := c.get(key, now, n.cl.cfg.FetchTimeout); ok {
			return e.data, e.crc, nil
		}
	}
	b, crc, err := n.store.ReadChunk(key) // a corrupt chunk is dropped, its BlockRemoved journaled
	if err != nil {
		return nil, 0, fmt.Errorf("%w: %w", cluster.ErrNoChunk, err)
	}
	c.put(servedChunk{key: key, data: b, crc: crc, at: now})
	return b, crc, nil
}

// heldKeys is this node's (namespace, key) set as its kv_events announced
// it: what it serves to fetches and key-set catch-ups.
type heldKeys struct {
	mu sync.Mutex
	// m is the set by namespace (a namespace with no key has no entry),
	// so that an AllBlocksCleared costs that namespace's keys, not every
	// namespace's: under engine churn a node forgets a namespace per
	// fresh-id register. n counts the keys.
	m map[string]map[messages.Key]struct{}
	n int
	// sorted is the set in order as of the last page served, and changes
	// what changed since (true: added): a page merges them in one pass when
	// the set changed, and costs a search when it did not. A sort of the
	// whole set per page made a catch-up quadratic in its size.
	//
	// Only a page clears changes, and a steady cluster pages nobody's set,
	// so changes would keep every key ever stored: once it outgrows the set
	// (heldKeysChangesSlack over n) both are dropped and stale set,
	// and the next page sorts a copy of m instead of merging (a sort of the
	// set, costing no more than the merge of that many changes would).
	sorted  cluster.SortedKeys
	changes map[holders.NSKey]bool
	stale   bool
	// merging holds one merge at a time, outside mu: the journal's observe
	// takes mu and must not wait on a pass over the whole set.
	merging sync.Mutex
}

// heldKeysChangesSlack is how many more changes than keys held heldKeys
// keeps before it drops them and the sorted copy.
const heldKeysChangesSlack = 1024

func newHeldKeys() *heldKeys {
	return &heldKeys{m: map[string]map[messages.Key]struct{}{}, changes: map[holders.NSKey]bool{}}
}

// observe is the journal's observer: keys (pool keys) of namespace ns
// were announced as typ in medium; an AllBlocksCleared drops ns's keys
// (the node forgot ns: it serves none of them).
func (h *heldKeys) observe(typ, medium, ns string, keys []messages.Key) {
	if medium != messages.MediumCPU {
		return // the disk tier's: fetches are served from host memory only
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if typ == messages.KVAllBlocksCleared {
		if !h.stale {
			for k := range h.m[ns] {
				h.changes[holders.NSKey{NS: ns, Key: k}] = false
			}
		}
		h.n -= len(h.m[ns])
		delete(h.m, ns)
	}
	for _, k := range keys {
		nk := holders.NSKey{NS: ns, Key: sched.WireKey(k)} // hash and group, as holders.KeyOf makes it
		switch typ {
		case messages.KVBlockStored:
			set := h.m[ns]
			if set == nil {
				set = map[messages.Key]struct{}{}
				h.m[ns] = set
			}
			if _, ok := set[nk.Key]; !ok {
				set[nk.Key] = struct{}{}
				h.n++
			}
			if !h.stale {
				h.changes[nk] = true
			}
		case messages.KVBlockRemoved:
			if set := h.m[ns]; set != nil {
				if _, ok := set[nk.Key]; ok {
					delete(set, nk.Key)
					h.n--
				}
				if len(set) == 0 {
					delete(h.m, ns) // none kept for a namespace that is gone
				}
			}
			if !h.stale {
				h.changes[nk] = false
			}
		}
	}
	if !h.stale && len(h.changes) > h.n+heldKeysChangesSlack {
		h.stale, h.sorted, h.changes = true, nil, map[holders.NSKey]bool{}
	}
}

func (h *heldKeys) has(ns string, key messages.Key) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	_, ok := h.m[ns][key]
	return ok
}

// KeysAfter lists the set in (namespace, key) order (cluster.KeySource),
// as it was when called.
func (h *heldKeys) KeysAfter(after holders.NSKey, max int) []holders.NSKey {
	h.merging.Lock()
	defer h.merging.Unlock()
	h.mu.Lock()
	sorted, changes := h.sorted, h.changes
	var keys []holders.NSKey
	rebuild := h.stale
	if rebuild {
		// A copy of the set under mu (no sort: that is done outside it);
		// changes observed from here on are recorded again, on top of it.
		keys = make([]holders.NSKey, 0, h.n)
		for ns, set := range h.m {
			for k := range set {
				keys = append(keys, holders.NSKey{NS: ns, Key: k})
			}
		}
		h.stale = false
	}
	// Decided under mu: an empty changes map stays the live one, which
	// observe may write as soon as mu is let go.
	update := rebuild || len(changes) > 0
	if update {
		h.changes = map[holders.NSKey]bool{}
	}
	h.mu.Unlock()
	if update {
		// Changes observed from here on go to the new map, on top of
		// this merge's (or sort's) result.
		if rebuild {
			sorted = cluster.NewSortedKeys(keys)
		} else {
			sorted = sorted.Apply(changes)
		}
		h.mu.Lock()
		if !h.stale { // else dropped meanwhile: the next page sorts the set
			h.sorted = sorted
		}
		h.mu.Unlock()
	}
	return sorted.KeysAfter(after, max)
}

// poolKey is the pool key of wire key wk (hash, then group as 4 bytes) in
// namespace ns (messages.NamespaceKey) of geometry geo; an error if ns has
// no id on this node or holds another geometry here.
func (n *Node) poolKey(ns string, geo uint64, wk messages.Key) (messages.Key, error) {
	if len(wk) <= 4 {
		return "", fmt.Errorf("key %x: too short", []byte(wk))
	}
	n.mu.Lock()
	rec := n.nss.byKey[ns]
	n.mu.Unlock()
	if rec == nil {
		return "", fmt.Errorf("namespace %s not open on this node", ns)
	}
	if rec.geo != geo {
		return "", fmt.Errorf("namespace %s has geometry %s on this node, the fetch asks for %s",
			ns, messages.GeometryHex(rec.geo), messages.GeometryHex(geo))
	}
	g := binary.BigEndian.Uint32([]byte(wk[len(wk)-4:]))
	return sched.Key(rec.id, messages.Hash(wk[:len(wk)-4]), int(g)), nil
}
