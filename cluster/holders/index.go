package holders

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kvactors/kvactors/messages"
)

// NSKey is an offload key in its namespace: keys never match across
// namespaces (shared PROTOCOL.md, Isolation).
type NSKey struct {
	NS  string
	Key messages.Key
}

// Errors. Every rejected input changes nothing and is counted in Stats.
var (
	ErrBadEvent  = errors.New("holders: bad kv event")
	ErrStaleBoot = errors.New("holders: message of a retired boot")
	ErrNoSync    = errors.New("holders: no such catch-up")
)

// retiredBoots bounds how many past boots of a node are remembered, so a
// late message of one never brings a dead process back.
const retiredBoots = 8

// Stats counts what the index refused or dropped.
type Stats struct {
	Rejected uint64 // malformed kv_events batches
	Stale    uint64 // messages of a retired boot
	Expired  uint64 // nodes dropped for silence
	Rebooted uint64 // nodes seen with a new boot
	OverCap  uint64 // keys stored or paged that were not indexed: their node held maxKeys
}

// Applied is what an accepted kv_events batch or catch-up page did that its
// caller acts on (a refused one returns an error and changes nothing).
type Applied struct {
	// Cleared: the batch held a host-memory AllBlocksCleared of a
	// namespace and the node's keys in it went; the caller asks for its key
	// set again, which lists those it still holds (ApplyKVEvents only).
	Cleared bool
	// OverCap counts the keys the input stored or listed that were not
	// indexed because their node held maxKeys keys: they are left out, as
	// if missed (a lookup then counts too few holders, never a wrong one).
	OverCap int
	// Capped: this input found the node at its cap first since its keys
	// were last known whole (the node new or rebooted, its keys cleared,
	// or a catch-up finished without meeting the cap). The caller logs it
	// once per crossing, not once per key.
	Capped bool
	// Abandoned: the node's catch-up in progress was given up, its removals
	// meanwhile past what the index keeps for it (maxKeys): the caller asks
	// for its key set again (ApplyKVEvents only).
	Abandoned bool
}

type node struct {
	boot     string
	lastSeen time.Time // last hello or heartbeat; zero if none yet
	// unheard: when Expire first found the node with no hello or
	// heartbeat yet (its kv_events came first); it is forgotten a lease on
	// unless one comes.
	unheard time.Time
	retired []string
	// keys maps each namespace's keys to the id of the last catch-up that
	// confirmed each (a page listed it, or it was stored while that
	// catch-up ran); a catch-up that completes drops the keys it did not
	// confirm. By namespace, so a clear of one (a node's reconnect clears
	// each of its namespaces) drops its keys without a pass over the rest.
	keys  map[string]map[messages.Key]uint64
	count int // keys indexed, all namespaces: what the cap bounds
	sync  *catchUp
	// capped: a key of this node was left out at the cap since its keys
	// were last known whole (see Applied.Capped).
	capped bool
}

// catchUp is a key-set request in progress: removals seen meanwhile win
// over the (older) page that may still list them, and stores seen
// meanwhile over the pages that may not.
type catchUp struct {
	id      uint64
	boot    string
	removed map[NSKey]struct{}
	overCap bool // a key was left out at the cap while it ran
	// swept: the keys no page had listed were dropped when it met the cap
	// (add); every key of the node has been confirmed by it since.
	swept bool
}

// Index knows which live nodes hold which keys. Not safe for concurrent
// use: one goroutine (the holder actor) owns it.
type Index struct {
	lease   time.Duration
	maxKeys int // per node; 0: no bound
	nodes   map[string]*node
	held    map[NSKey][]string // sorted node ids
	syncID  uint64
	stats   Stats
}

// New returns an empty index; a node counts as a holder while its last
// hello or heartbeat is younger than lease. At most maxKeys keys of each
// node are indexed (0 or less: no bound): a store or page of a node that
// holds maxKeys adds nothing, so one node announcing an unbounded key set
// cannot grow the index without bound. Its removals still apply, and its
// keys already indexed stay until a catch-up of it replaces them
// (FinishCatchUp); other nodes are not affected.
func New(lease time.Duration, maxKeys int) *Index {
	return &Index{lease: lease, maxKeys: max(maxKeys, 0), nodes: map[string]*node{}, held: map[NSKey][]string{}}
}

// Stats returns the counters.
func (x *Index) Stats() Stats { return x.stats }

// Heartbeat records a hello or heartbeat of node at now. It reports true
// when the node is new to the index or has a new boot: the caller asks it
// for its key set (catch-up).
func (x *Index) Heartbeat(nodeID, boot string, now time.Time) (catchUpNeeded bool, err error) {
	n, fresh, err := x.current(nodeID, boot)
	if err != nil {
		return false, err
	}
	catchUpNeeded = fresh || n.lastSeen.IsZero() || !x.live(n, now)
	n.lastSeen = now
	return catchUpNeeded, nil
}

// current returns node's state for boot, switching to boot if it is new
// (every key of the old boot dropped); a retired boot is refused.
func (x *Index) current(nodeID, boot string) (*node, bool, error) {
	n := x.nodes[nodeID]
	if n == nil {
		n = &node{boot: boot, keys: map[string]map[messages.Key]uint64{}}
		x.nodes[nodeID] = n
		return n, true, nil
	}
	if n.boot == boot {
		return n, false, nil
	}
	if slices.Contains(n.retired, boot) {
		x.stats.Stale++
		return nil, false, fmt.Errorf("%w: node %s boot %s", ErrStaleBoot, nodeID, boot)
	}
	x.stats.Rebooted++
	x.dropKeys(nodeID, n)
	n.retired = append(n.retired, n.boot)
	if len(n.retired) > retiredBoots {
		n.retired = n.retired[1:]
	}
	n.boot, n.sync, n.lastSeen, n.unheard = boot, nil, time.Time{}, time.Time{}
	return n, true, nil
}

// ApplyKVEvents applies one P.E.kv_events batch that node (boot) published
// for engine, of namespaces of geometry (messages.HeaderGeometry):
// BlockStored adds, BlockRemoved removes, AllBlocksCleared of a namespace
// drops the node's keys in it (the caller then asks for its key set again,
// so this errs on the side of counting too little), and the contract's
// AllBlocksCleared at an engine's first register, which names none, drops
// nothing: the node's pool is as it was. A key's namespace is the event's, else
// the engine id (the namespace default), keyed as messages.NamespaceKey
// keys it and qualified by the geometry (messages.ClusterNamespace), as a
// node's lookup asks for it: a node counts a key only for an engine of the
// same geometry. A malformed batch changes nothing. Only host-memory
// events count (medium CPU, or none given): a disk tier's events, its
// clears included, are skipped. A store past the node's cap is left out
// (Applied.OverCap).
func (x *Index) ApplyKVEvents(nodeID, boot, engine string, geometry uint64, b messages.KVEventBatch) (Applied, error) {
	return x.applyKVEvents(nodeID, boot, func(name string) string {
		return messages.ClusterNamespace(messages.NamespaceKey(engine, name), geometry)
	}, b)
}

// applyKVEvents is ApplyKVEvents with each event's namespace keyed by nsOf.
func (x *Index) applyKVEvents(nodeID, boot string, nsOf func(name string) string, b messages.KVEventBatch) (Applied, error) {
	type op struct {
		typ  string
		keys []NSKey
		ns   string // a clear's
	}
	ops := make([]op, 0, len(b.Events))
	var lastName, lastNS string // a batch's events mostly name one namespace: its key is built once
	for i, ev := range b.Events {
		o := op{typ: ev.Type}
		switch ev.Type {
		case messages.KVBlockStored, messages.KVBlockRemoved:
			if ev.Medium != "" && ev.Medium != messages.MediumCPU {
				// A node fetches only from host memory: its disk tier's
				// writes and deletions say nothing about what it can serve.
				continue
			}
			if lastNS == "" || ev.Namespace != lastName {
				lastName, lastNS = ev.Namespace, nsOf(ev.Namespace)
			}
			ns := lastNS
			if ev.GroupIdx < 0 {
				x.stats.Rejected++
				return Applied{}, fmt.Errorf("%w: event %d: group %d", ErrBadEvent, i, ev.GroupIdx)
			}
			for _, h := range ev.BlockHashes {
				raw, err := hex.DecodeString(h)
				if err != nil || len(raw) == 0 {
					x.stats.Rejected++
					return Applied{}, fmt.Errorf("%w: event %d: hash %q is not hex", ErrBadEvent, i, h)
				}
				o.keys = append(o.keys, NSKey{NS: ns, Key: KeyOf(raw, ev.GroupIdx)})
			}
		case messages.KVAllBlocksCleared:
			if ev.Medium != "" && ev.Medium != messages.MediumCPU {
				// A disk tier's clear (each namespace's first register in
				// a boot) says nothing of host memory either; applied, any
				// engine opening a namespace had every other node forget
				// all of the node's keys, every tenant's, until a catch-up.
				continue
			}
			if ev.Namespace == "" {
				// The contract's clear at an engine's first register in a
				// boot: a router's view of the node for that engine starts
				// over, the pool does not (a new boot is its header's).
				// Applied, any engine registering had every other node
				// forget all of the node's keys, every tenant's, until a
				// catch-up. A clear the node means names each namespace.
				continue
			}
			o.ns = nsOf(ev.Namespace)
		default:
			x.stats.Rejected++
			return Applied{}, fmt.Errorf("%w: event %d: type %q", ErrBadEvent, i, ev.Type)
		}
		ops = append(ops, o)
	}
	n, _, err := x.current(nodeID, boot)
	if err != nil {
		return Applied{}, err
	}
	var out Applied
	for _, o := range ops {
		switch o.typ {
		case messages.KVBlockStored:
			for _, k := range o.keys {
				x.add(nodeID, n, k, &out)
			}
		case messages.KVBlockRemoved:
			for _, k := range o.keys {
				x.remove(nodeID, n, k, &out)
			}
		case messages.KVAllBlocksCleared:
			// The namespace's changes were lost (the node's reconnect) or
			// dropped (deferred past their bound): forget its keys, and
			// read the set again for those still held.
			x.dropNamespace(nodeID, n, o.ns)
			n.sync = nil // its pages may list keys whose removal was lost
			out.Cleared = true
		}
	}
	return out, nil
}

// KeyOf is the offload key of a block hash in a group: the hash bytes and
// the group as 4 big-endian bytes (shared PROTOCOL.md, Words).
func KeyOf(hash []byte, group int) messages.Key {
	k := make([]byte, len(hash)+4)
	copy(k, hash)
	binary.BigEndian.PutUint32(k[len(hash):], uint32(group))
	return messages.Key(k)
}

// add indexes k as held by n. A key n does not have yet is left out when n
// holds maxKeys already (counted in out): its earlier keys stay, and a
// removal frees room for a later store. During a catch-up the cap is met
// first by dropping the keys no page has listed yet (once per catch-up):
// any of them may be gone, evicted while this node missed its
// BlockRemoved, and kept they would take the room of keys the node holds
// and outlive a catch-up cut at the cap; those it still holds come back
// with their page.
func (x *Index) add(nodeID string, n *node, k NSKey, out *Applied) {
	var stamp uint64
	if n.sync != nil {
		delete(n.sync.removed, k) // the node holds it now, indexed or not
		stamp = n.sync.id
	}
	if keys := n.keys[k.NS]; keys != nil {
		if _, ok := keys[k.Key]; ok {
			keys[k.Key] = stamp
			return
		}
	}
	if x.maxKeys > 0 && n.count >= x.maxKeys && n.sync != nil && !n.sync.swept {
		n.sync.swept = true
		x.sweep(nodeID, n)
	}
	if x.maxKeys > 0 && n.count >= x.maxKeys {
		x.stats.OverCap++
		out.OverCap++
		if n.sync != nil {
			n.sync.overCap = true
		}
		if !n.capped {
			n.capped, out.Capped = true, true
		}
		return
	}
	keys := n.keys[k.NS]
	if keys == nil {
		keys = map[messages.Key]uint64{}
		n.keys[k.NS] = keys
	}
	keys[k.Key] = stamp
	n.count++
	hs := x.held[k]
	i, _ := slices.BinarySearch(hs, nodeID)
	x.held[k] = slices.Insert(hs, i, nodeID)
}

// minRemovedBound is the least a catch-up remembers of the removals
// meanwhile, whatever the cap per node: a small cap would otherwise give up
// every catch-up of a node that evicts at all while it is read.
const minRemovedBound = 1 << 16

func (x *Index) remove(nodeID string, n *node, k NSKey, out *Applied) {
	if n.sync != nil {
		if x.maxKeys > 0 && len(n.sync.removed) >= max(x.maxKeys, minRemovedBound) {
			// The removals a catch-up must remember are bounded as the keys
			// are: past the bound (a node removing without end while its
			// pages go on), the catch-up is given up and asked again.
			n.sync = nil
			out.Abandoned = true
		} else {
			n.sync.removed[k] = struct{}{}
		}
	}
	keys := n.keys[k.NS]
	if _, ok := keys[k.Key]; !ok {
		return
	}
	delete(keys, k.Key)
	if len(keys) == 0 {
		delete(n.keys, k.NS)
	}
	n.count--
	x.unhold(nodeID, k)
}

func (x *Index) unhold(nodeID string, k NSKey) {
	hs := x.held[k]
	if i, ok := slices.BinarySearch(hs, nodeID); ok {
		hs = slices.Delete(hs, i, i+1)
	}
	if len(hs) == 0 {
		delete(x.held, k)
	} else {
		x.held[k] = hs
	}
}

// sweep drops the keys of n that its catch-up has not confirmed (n.sync
// set): not listed by a page, nor stored since it began.
func (x *Index) sweep(nodeID string, n *node) {
	for ns, keys := range n.keys {
		for k, stamp := range keys {
			if stamp != n.sync.id {
				delete(keys, k)
				n.count--
				x.unhold(nodeID, NSKey{ns, k})
			}
		}
		if len(keys) == 0 {
			delete(n.keys, ns)
		}
	}
}

func (x *Index) dropKeys(nodeID string, n *node) {
	for ns := range n.keys {
		x.dropNamespace(nodeID, n, ns)
	}
	n.capped = false // nothing left out of an empty set
}

// dropNamespace drops n's keys in ns. n.capped stays: keys of the others
// may have been left out at the cap.
func (x *Index) dropNamespace(nodeID string, n *node, ns string) {
	for k := range n.keys[ns] {
		x.unhold(nodeID, NSKey{ns, k})
	}
	n.count -= len(n.keys[ns])
	delete(n.keys, ns)
}

// BeginCatchUp starts a key-set catch-up of node (boot): from now until
// FinishCatchUp or EndCatchUp, a key removed by a kv_event is not re-added
// by a page that was read before the removal, and a key stored by one is
// kept though a page read before the store did not list it. A second
// BeginCatchUp supersedes the first.
func (x *Index) BeginCatchUp(nodeID, boot string) (uint64, error) {
	n, _, err := x.current(nodeID, boot)
	if err != nil {
		return 0, err
	}
	x.syncID++
	n.sync = &catchUp{id: x.syncID, boot: boot, removed: map[NSKey]struct{}{}}
	return x.syncID, nil
}

// CatchUpPage adds one page of the node's key set; keys past the node's
// cap are left out (Applied.OverCap), and the caller may stop reading
// pages there and finish (see FinishCatchUp): a node that announces more
// keys than the cap costs one catch-up of about cap keys, not of its whole
// set. The first key that finds the node at its cap drops, once, the
// keys no page has listed yet (see add), so until the pages list them
// again a lookup counts fewer of them; a key is left out only once every
// key of the node has been confirmed.
func (x *Index) CatchUpPage(nodeID string, id uint64, keys []NSKey) (Applied, error) {
	n := x.nodes[nodeID]
	if n == nil || n.sync == nil || n.sync.id != id {
		return Applied{}, fmt.Errorf("%w: node %s catch-up %d", ErrNoSync, nodeID, id)
	}
	var out Applied
	for _, k := range keys {
		if _, gone := n.sync.removed[k]; !gone {
			x.add(nodeID, n, k, &out)
		}
	}
	return out, nil
}

// FinishCatchUp completes catch-up id, whose pages listed the node's whole
// key set, or every key up to the node's cap (a caller may stop at the
// first page that met it). The node's keys become what the pages listed
// and what kv_events stored meanwhile: keys it no longer holds, whose
// BlockRemoved this node missed (a reconnect, a dropped message), go.
// Listed whole, its keys are whole again (Applied.Capped may be reported
// again). Cut at the cap, they are the node's first keys in page order up
// to the cap (the keys no page had reached were dropped when the cap was
// met: add), never a key the pages did not list. A no-op if superseded.
func (x *Index) FinishCatchUp(nodeID string, id uint64) {
	n := x.nodes[nodeID]
	if n == nil || n.sync == nil || n.sync.id != id {
		return
	}
	x.sweep(nodeID, n) // cut at the cap: swept there already, nothing left
	if !n.sync.overCap {
		n.capped = false
	}
	n.sync = nil
}

// EndCatchUp ends catch-up id without changing the keys (it failed or was
// cancelled; a no-op if it was finished or superseded). Keys it dropped at
// the cap (add) stay dropped: the caller's retry lists them again.
func (x *Index) EndCatchUp(nodeID string, id uint64) {
	if n := x.nodes[nodeID]; n != nil && n.sync != nil && n.sync.id == id {
		n.sync = nil
	}
}

func (x *Index) live(n *node, now time.Time) bool {
	return !n.lastSeen.IsZero() && now.Sub(n.lastSeen) < x.lease
}

// Holders returns the live nodes that hold key in ns, sorted.
func (x *Index) Holders(ns string, key messages.Key, now time.Time) []string {
	var out []string
	for _, id := range x.held[NSKey{ns, key}] {
		if x.live(x.nodes[id], now) {
			out = append(out, id)
		}
	}
	return out
}

// HeldElsewhere reports whether a live node other than self holds key in ns.
func (x *Index) HeldElsewhere(ns string, key messages.Key, self string, now time.Time) bool {
	for _, id := range x.held[NSKey{ns, key}] {
		if id != self && x.live(x.nodes[id], now) {
			return true
		}
	}
	return false
}

// Expire forgets every node silent for a lease or longer, with its keys and
// retired boots, returning their ids sorted, and a node never heard (its
// kv_events came, no hello or heartbeat) a lease after Expire first found
// it so: one that died at once stayed indexed for the process's life.
// Holders already ignores such nodes; Expire frees their memory. A
// forgotten node that speaks again is new: the caller catches it up.
func (x *Index) Expire(now time.Time) []string {
	var gone []string
	for id, n := range x.nodes {
		heard := !n.lastSeen.IsZero()
		if !heard && n.unheard.IsZero() {
			n.unheard = now
		}
		if heard && !x.live(n, now) || !heard && now.Sub(n.unheard) >= x.lease {
			x.dropKeys(id, n)
			delete(x.nodes, id)
			gone = append(gone, id)
			x.stats.Expired++
		}
	}
	slices.Sort(gone)
	return gone
}

// NodeInfo is one node as the index sees it.
type NodeInfo struct {
	Node     string
	Boot     string
	LastSeen time.Time
	Live     bool
	Keys     int
	// Capped: keys of the node were left out at the cap since its keys
	// were last known whole, so Keys counts fewer than it holds.
	Capped bool
}

// Nodes lists every known node, sorted by id.
func (x *Index) Nodes(now time.Time) []NodeInfo {
	out := make([]NodeInfo, 0, len(x.nodes))
	for id, n := range x.nodes {
		out = append(out, NodeInfo{Node: id, Boot: n.boot, LastSeen: n.lastSeen, Live: x.live(n, now), Keys: n.count, Capped: n.capped})
	}
	slices.SortFunc(out, func(a, b NodeInfo) int { return strings.Compare(a.Node, b.Node) })
	return out
}
