package holders

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"testing/quick"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// naive is the deliberately simple model the index is checked against:
// per node a list of facts, and Holders by scanning every node.
type naive struct {
	lease   time.Duration
	maxKeys int // 0: no cap
	nodes   map[string]*naiveNode
	sync    uint64
	overCap uint64
}

type naiveNode struct {
	boot     string
	seen     time.Time
	unheard  time.Time // when an Expire first found it never seen
	retired  []string
	keys     map[NSKey]bool
	syncID   uint64
	syncGone map[NSKey]bool // removed during the catch-up
	syncSeen map[NSKey]bool // listed by its pages or stored during it
	syncOver bool           // a key was left out at the cap during it
	syncCut  bool           // the keys it had not seen were dropped at the cap
	capped   bool           // a key was left out since the keys were last whole
}

// add is a store or a page's key: left out, and counted, when the node
// already has maxKeys others; during a catch-up, only once the keys it has
// not seen are dropped (the first time the cap is met).
func (m *naive) add(n *naiveNode, k NSKey, out *Applied) {
	if !n.keys[k] && m.maxKeys > 0 && len(n.keys) >= m.maxKeys && n.syncID != 0 && !n.syncCut {
		n.syncCut = true
		m.unseen(n)
	}
	if !n.keys[k] && m.maxKeys > 0 && len(n.keys) >= m.maxKeys {
		m.overCap++
		out.OverCap++
		if n.syncID != 0 {
			n.syncOver = true
		}
		out.Capped = out.Capped || !n.capped
		n.capped = true
		return
	}
	n.keys[k] = true
	if n.syncID != 0 {
		n.syncSeen[k] = true
	}
}

// unseen drops the node's keys its catch-up has not seen.
func (m *naive) unseen(n *naiveNode) {
	for k := range n.keys {
		if !n.syncSeen[k] {
			delete(n.keys, k)
		}
	}
}

func (m *naive) node(id, boot string) *naiveNode {
	n := m.nodes[id]
	if n == nil {
		n = &naiveNode{boot: boot, keys: map[NSKey]bool{}}
		m.nodes[id] = n
		return n
	}
	if n.boot == boot {
		return n
	}
	if slices.Contains(n.retired, boot) {
		return nil
	}
	n.retired = append(n.retired, n.boot)
	*n = naiveNode{boot: boot, keys: map[NSKey]bool{}, retired: n.retired}
	return n
}

func (m *naive) holders(k NSKey, now time.Time) []string {
	var out []string
	for id, n := range m.nodes {
		if n.keys[k] && !n.seen.IsZero() && now.Sub(n.seen) < m.lease {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
}

// The index and the model agree on every key's holders after every step of
// random sequences of heartbeats (new and stale boots), stores, removals,
// clears, catch-ups, time passing and expiry; with a cap on each node's
// keys, no node ever has more indexed than the cap, and the keys left out,
// their count and the crossings reported are the model's, as are the keys
// a catch-up drops when it meets the cap.
func TestQuickIndexMatchesNaiveModel(t *testing.T) {
	// 18 keys in all: no cap, caps that bind often, one that binds rarely.
	for _, maxKeys := range []int{0, 1, 4, 12} {
		t.Run(fmt.Sprintf("max_keys=%d", maxKeys), func(t *testing.T) { quickIndexMatchesNaiveModel(t, maxKeys) })
	}
}

func quickIndexMatchesNaiveModel(t *testing.T, maxKeys int) {
	nodes := []string{"a", "b", "c"}
	hashes := []string{"01", "02", "03"}
	// Two shared namespaces and the engine's own, named outright and by
	// default: the engine's own is one namespace, apart from every shared one.
	nss := []string{"m", "n", "e", ""}
	var universe []NSKey
	for _, ns := range []string{".m", ".n", "e"} {
		for _, h := range hashes {
			for g := range 2 {
				universe = append(universe, NSKey{ns, key(t, h, g)})
			}
		}
	}
	var overCap uint64 // over every sequence
	check := func(seed uint64) bool {
		r := rand.New(rand.NewPCG(seed, 7))
		x := New(lease, maxKeys)
		m := &naive{lease: lease, maxKeys: maxKeys, nodes: map[string]*naiveNode{}}
		now := t0
		boots := map[string]int{}
		bootOf := func(id string) string {
			// Mostly the current boot, sometimes a new one, sometimes an old one.
			switch p := r.IntN(20); {
			case p == 0 && boots[id] < 5:
				boots[id]++
			case p == 1 && boots[id] > 0:
				return fmt.Sprintf("%s%d", id, r.IntN(boots[id]))
			}
			return fmt.Sprintf("%s%d", id, boots[id])
		}
		catchUps := map[string]uint64{}
		for step := range 300 {
			id := nodes[r.IntN(len(nodes))]
			boot := bootOf(id)
			switch op := r.IntN(10); op {
			case 0, 1:
				_, err := x.Heartbeat(id, boot, now)
				if n := m.node(id, boot); n != nil {
					require.NoError(t, err)
					n.seen = now
				} else {
					require.ErrorIs(t, err, ErrStaleBoot)
				}
			case 2, 3, 4:
				typ := messages.KVBlockStored
				if op == 4 {
					typ = messages.KVBlockRemoved
				}
				ns, h, g := nss[r.IntN(len(nss))], hashes[r.IntN(len(hashes))], r.IntN(2)
				got, err := x.applyPlain(id, boot, "e", batch(messages.KVEvent{Type: typ, BlockHashes: []string{h}, GroupIdx: g, Namespace: ns}))
				n := m.node(id, boot)
				if n == nil {
					require.ErrorIs(t, err, ErrStaleBoot)
					break
				}
				require.NoError(t, err)
				k := NSKey{messages.NamespaceKey("e", ns), key(t, h, g)}
				var want Applied
				if typ == messages.KVBlockStored {
					delete(n.syncGone, k) // stored, indexed or not: a page may list it
					m.add(n, k, &want)
				} else {
					delete(n.keys, k)
					if n.syncID != 0 {
						n.syncGone[k] = true
					}
				}
				require.Equal(t, want, got, "seed %d step %d", seed, step)
			case 5:
				// A clear of one namespace; "": the contract's at an
				// engine's first register, which changes nothing.
				ns := nss[r.IntN(len(nss))]
				got, err := x.applyPlain(id, boot, "e", batch(messages.KVEvent{Type: messages.KVAllBlocksCleared, Namespace: ns}))
				if n := m.node(id, boot); n != nil {
					require.NoError(t, err)
					var want Applied
					if ns != "" {
						for k := range n.keys {
							if k.NS == messages.NamespaceKey("e", ns) {
								delete(n.keys, k)
							}
						}
						n.syncID, n.syncGone, n.syncSeen, n.syncOver, n.syncCut = 0, nil, nil, false, false
						want.Cleared = true
					}
					require.Equal(t, want, got, "seed %d step %d", seed, step)
				}
			case 6:
				sid, err := x.BeginCatchUp(id, boot)
				if n := m.node(id, boot); n != nil {
					require.NoError(t, err)
					m.sync++
					require.Equal(t, m.sync, sid)
					n.syncID, n.syncGone, n.syncSeen, n.syncOver, n.syncCut = sid, map[NSKey]bool{}, map[NSKey]bool{}, false, false
					catchUps[id] = sid
				}
			case 7:
				sid := catchUps[id]
				var page []NSKey
				for _, k := range universe {
					if r.IntN(3) == 0 {
						page = append(page, k)
					}
				}
				got, err := x.CatchUpPage(id, sid, page)
				n := m.nodes[id]
				if n == nil || n.syncID == 0 || n.syncID != sid {
					require.ErrorIs(t, err, ErrNoSync)
					break
				}
				require.NoError(t, err)
				var want Applied
				for _, k := range page {
					if !n.syncGone[k] {
						m.add(n, k, &want)
					}
				}
				require.Equal(t, want, got, "seed %d step %d", seed, step)
				switch r.IntN(3) {
				case 0: // failed: the keys stay
					x.EndCatchUp(id, sid)
					n.syncID, n.syncGone, n.syncSeen, n.syncOver, n.syncCut = 0, nil, nil, false, false
				case 1: // done: the keys are what it listed and what was stored meanwhile
					x.FinishCatchUp(id, sid)
					m.unseen(n) // cut at the cap or not: no key it did not see stays
					if !n.syncOver {
						n.capped = false // the node's keys are whole again
					}
					n.syncID, n.syncGone, n.syncSeen, n.syncOver, n.syncCut = 0, nil, nil, false, false
				}
			case 8:
				now = now.Add(time.Duration(r.IntN(4)) * time.Second)
			case 9:
				gone := x.Expire(now)
				var want []string
				for nid, n := range m.nodes {
					if n.seen.IsZero() && n.unheard.IsZero() {
						n.unheard = now
					}
					if !n.seen.IsZero() && now.Sub(n.seen) >= lease || n.seen.IsZero() && now.Sub(n.unheard) >= lease {
						want = append(want, nid)
						delete(m.nodes, nid)
					}
				}
				slices.Sort(want)
				require.Equal(t, want, gone, "expired at step %d", step)
			}
			for _, k := range universe {
				require.Equal(t, m.holders(k, now), x.Holders(k.NS, k.Key, now), "seed %d step %d key %x/%s", seed, step, k.Key, k.NS)
			}
			for _, ni := range x.Nodes(now) {
				n := m.nodes[ni.Node]
				require.NotNil(t, n, "seed %d step %d node %s", seed, step, ni.Node)
				if maxKeys > 0 {
					require.LessOrEqual(t, ni.Keys, maxKeys, "seed %d step %d node %s over the cap", seed, step, ni.Node)
				}
				require.Equal(t, len(n.keys), ni.Keys, "seed %d step %d node %s", seed, step, ni.Node)
				require.Equal(t, n.capped, ni.Capped, "seed %d step %d node %s", seed, step, ni.Node)
			}
			require.Len(t, x.Nodes(now), len(m.nodes), "seed %d step %d", seed, step)
			require.Equal(t, m.overCap, x.Stats().OverCap, "seed %d step %d", seed, step)
		}
		overCap += m.overCap
		return true
	}
	require.NoError(t, quick.Check(check, &quick.Config{MaxCount: 50}))
	if maxKeys > 0 && maxKeys < 12 {
		require.NotZero(t, overCap, "the cap never bound: the sequences test nothing of it")
	}
}
