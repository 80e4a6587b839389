package client

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
)

// modelNode applies events as the protocol says, far enough to compare
// what two event streams leave behind: hashes, block ids, tokens, phase,
// and the releases it publishes (at once: it makes no copies). Each
// release carries the blocks the real node may still copy until it is out.
type modelNode struct {
	reqs     map[string]*modelReq
	releases []modelRel // in order
}

type modelReq struct {
	hashes    []string
	blocks    [][]messages.BlockID
	computed  int
	total     int
	preempted bool
}

// modelRel is a release and the blocks the node may copy until it is
// published: those the preempted or finished it answers gave up.
type modelRel struct {
	req    string
	covers []blockRef
}

type blockRef struct {
	group int
	id    uint32
}

func refs(blocks [][]messages.BlockID) []blockRef {
	var out []blockRef
	for g, ids := range blocks {
		for _, id := range ids {
			out = append(out, blockRef{g, uint32(id)})
		}
	}
	return out
}

func newModel() *modelNode { return &modelNode{reqs: map[string]*modelReq{}} }

func (m *modelNode) apply(ev messages.Event) {
	r := m.reqs[ev.Request]
	if r == nil && ev.Type != messages.EvAdded {
		if ev.Type == messages.EvFinished {
			m.releases = append(m.releases, modelRel{req: ev.Request})
		}
		return
	}
	switch ev.Type {
	case messages.EvAdded:
		if r == nil {
			m.reqs[ev.Request] = &modelReq{blocks: make([][]messages.BlockID, 2)}
		}
	case messages.EvHashes:
		if ev.Start <= len(r.hashes) {
			for i := len(r.hashes) - ev.Start; i < len(ev.Hashes); i++ {
				r.hashes = append(r.hashes, string(ev.Hashes[i]))
			}
		}
	case messages.EvBlocks:
		if !r.preempted && ev.Start <= len(r.blocks[ev.Group]) {
			for i := len(r.blocks[ev.Group]) - ev.Start; i < len(ev.IDs); i++ {
				r.blocks[ev.Group] = append(r.blocks[ev.Group], ev.IDs[i])
			}
		}
	case messages.EvTokens:
		r.computed, r.total = ev.Computed, ev.Total
	case messages.EvPreempted:
		if !r.preempted {
			r.preempted = true
			r.computed = 0 // the node forgets it (sched.becomePreempted)
			m.releases = append(m.releases, modelRel{req: ev.Request, covers: refs(r.blocks)})
			r.blocks = make([][]messages.BlockID, 2)
		}
	case messages.EvResumed:
		if r.preempted {
			r.preempted = false
			r.blocks = make([][]messages.BlockID, 2)
		}
	case messages.EvFinished:
		// A preempted request's blocks were forgotten at preempted.
		delete(m.reqs, ev.Request)
		m.releases = append(m.releases, modelRel{req: ev.Request, covers: refs(r.blocks)})
	}
}

// engineModel is what the engine knows of its blocks: per request the
// blocks each owed release hands back, in order, and those handed back.
type engineModel struct {
	phase map[string]phase
	owed  map[string][][]blockRef
	freed map[string]map[blockRef]bool
}

func newEngineModel() *engineModel {
	return &engineModel{phase: map[string]phase{}, owed: map[string][][]blockRef{},
		freed: map[string]map[blockRef]bool{}}
}

// pending reports whether b of req is still to come back with an owed release.
func (e *engineModel) pending(req string, b blockRef) bool {
	for _, set := range e.owed[req] {
		if slices.Contains(set, b) {
			return true
		}
	}
	return false
}

// handedBack records that the client gave the engine req's next release.
func (e *engineModel) handedBack(t *testing.T, req string) {
	t.Helper()
	if len(e.owed[req]) == 0 {
		t.Fatalf("a release of %s reached the engine, which waits for none", req)
	}
	if e.freed[req] == nil {
		e.freed[req] = map[blockRef]bool{}
	}
	for _, b := range e.owed[req][0] {
		e.freed[req][b] = true
	}
	e.owed[req] = e.owed[req][1:]
}

// checkReuse fails if the node may still copy a block of a request that
// the engine was handed back (and may have reused): one it tracks, or one
// covered by a release not delivered yet.
func checkReuse(t *testing.T, e *engineModel, m *modelNode, when string) {
	t.Helper()
	for id, r := range m.reqs {
		for _, b := range refs(r.blocks) {
			if e.freed[id][b] {
				t.Fatalf("%s: the node tracks block %v of %s, which the engine got back", when, b, id)
			}
		}
	}
	for _, rel := range m.releases {
		for _, b := range rel.covers {
			if e.freed[rel.req][b] {
				t.Fatalf("%s: the node may copy block %v of %s until a later release, but the engine got it back",
					when, b, rel.req)
			}
		}
	}
}

// FuzzMirrorResync drives a client's mirror, a model node and a model
// engine with the same random events, delivers a random part of the
// model's releases, then resyncs into a fresh model node and delivers all
// of its releases. It checks that the new epoch leaves the fresh node with
// what the old one had for every live request (hashes, block ids of a
// running request, tokens, phase), that it publishes exactly the releases
// the engine still waits for, plus one absorbed silently for each
// preempted request that owed none, and that at no point may a node copy
// a block the engine was handed back through a release.
func FuzzMirrorResync(f *testing.F) {
	for _, seed := range []string{"", "\x00\x01\x02\x03\x04\x05\x06", "\x04\x00\x05\x06\x03\x04\x00\x06",
		"\x00\x02\x03\x04\x00\x05\x02\x06\xff\xfe", "\x10\x21\x32\x43\x54\x65\x76\x87\x98\xa9\xba\xcb\xdc\xed",
		// added, blocks, preempted, finished; then the preemption's
		// release, or not; and with that release before the finish
		"\x00\x00\x02\x00\x04\x00\x06\x00", "\x00\x00\x02\x00\x04\x00\x06\x00\x07\x01",
		"\x00\x00\x02\x00\x04\x00\x07\x01\x06\x00",
		// finished before any added (a request never added), then added,
		// blocks, preempted and one release delivered
		"&00020$071"} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, prog []byte) {
		c := &Client{reqs: map[string]*mreq{}, groups: 2, st: Stats{Resyncs: map[string]int{}},
			cfg: Config{Log: slog.New(slog.NewTextHandler(io.Discard, nil)), MaxBatchBytes: 1 << 30},
			out: newDispatcher(nil, nil, nil), epoch: "e1"}
		defer c.out.close()
		old := newModel()
		eng := newEngineModel()
		next := 0
		ids := func(b byte) []uint32 { return []uint32{uint32(b%7) + 1, uint32(b%5) + 9} }
		for i := 0; i+1 < len(prog); i += 2 {
			op, arg := prog[i]%8, prog[i+1]
			req := fmt.Sprintf("r%d", int(arg)%max(next, 1))
			if _, ok := eng.phase[req]; !ok && op != 0 {
				// Never added: a name op 0 never makes, so no release of it
				// can be taken for one of a later request with its name.
				req = "ghost"
			}
			if eng.phase[req] == finished && op != 0 && op != 7 {
				continue // ids are not reused after finishing
			}
			c.batch.Reset()
			switch op {
			case 0:
				req = fmt.Sprintf("r%d", next)
				next++
				c.Added(req, 16)
				eng.phase[req] = running
			case 1:
				c.Hashes(req, int(arg%3), []byte{arg}, []byte{arg + 1})
			case 2:
				g, fresh := int(arg%2), ids(arg)
				if eng.phase[req] == running {
					if slices.ContainsFunc(fresh, func(id uint32) bool { return eng.pending(req, blockRef{g, id}) }) {
						continue // an engine never hands out a block it has not got back
					}
					for _, id := range fresh {
						delete(eng.freed[req], blockRef{g, id}) // reallocated to it
					}
				}
				c.Blocks(req, g, int(arg%3), fresh)
			case 3:
				c.Tokens(req, int(arg), 200)
			case 4:
				if r := old.reqs[req]; r != nil && eng.phase[req] == running {
					eng.owed[req] = append(eng.owed[req], refs(r.blocks))
					eng.phase[req] = preempted
				}
				c.Preempted(req)
			case 5:
				if eng.phase[req] == preempted {
					eng.phase[req] = running
				}
				c.Resumed(req)
			case 6:
				if r := old.reqs[req]; r != nil {
					var back []blockRef // finished while preempted gives up nothing more
					if eng.phase[req] == running {
						back = refs(r.blocks)
					}
					eng.owed[req] = append(eng.owed[req], back)
				}
				eng.phase[req] = finished
				c.Finished(req, arg%2 == 0, int(arg), 200)
			case 7:
				deliverReleases(t, c, eng, old, int(arg%4))
				continue
			}
			applyBatch(t, &c.batch, old)
		}
		fresh := newModel()
		c.batch.Reset()
		var want []string // releases the engine still waits for, silent ones included
		for id, r := range c.reqs {
			for range r.owed {
				want = append(want, id)
			}
			if r.phase == preempted && r.owed == 0 {
				want = append(want, id)
			}
		}
		c.reannounceLocked(func() {})
		applyBatch(t, &c.batch, fresh)
		slices.Sort(want)
		var got []string
		for _, rel := range fresh.releases {
			got = append(got, rel.req)
		}
		slices.Sort(got)
		if !slices.Equal(want, got) {
			t.Fatalf("re-announced releases %v, want %v", got, want)
		}
		for id, o := range old.reqs {
			n := fresh.reqs[id]
			if n == nil {
				t.Fatalf("live request %s not re-announced", id)
			}
			if !slices.Equal(o.hashes, n.hashes) || o.preempted != n.preempted || o.computed != n.computed {
				t.Fatalf("request %s: old %+v, re-announced %+v", id, o, n)
			}
			for g := range o.blocks {
				if !o.preempted && !slices.Equal(o.blocks[g], n.blocks[g]) {
					t.Fatalf("request %s group %d: blocks %v, re-announced %v", id, g, o.blocks[g], n.blocks[g])
				}
			}
		}
		checkReuse(t, eng, fresh, "the new epoch")
		deliverReleases(t, c, eng, fresh, len(fresh.releases))
		for id, q := range eng.owed {
			if len(q) > 0 {
				t.Fatalf("%s still waits for %d releases after the new epoch's", id, len(q))
			}
		}
	})
}

// applyBatch decodes the batch as the node would and applies it.
func applyBatch(t *testing.T, b interface {
	Body([]byte, string, uint64) []byte
	Events() int
}, m *modelNode) {
	t.Helper()
	if b.Events() == 0 {
		return
	}
	dec, bad, err := ingest.DecodeBatch("e", b.Body(nil, "x", 1), ingest.Limits{})
	if err != nil || len(bad) > 0 {
		t.Fatalf("batch does not decode: %v %v", err, bad)
	}
	for _, ev := range dec.Events {
		m.apply(ev)
	}
}

// deliverReleases hands the client the first n releases the model has
// published and not delivered yet, as NATS messages of the current epoch,
// notes in the engine model each one the client passes on, and checks
// after each that no block the engine got back may still be copied.
func deliverReleases(t *testing.T, c *Client, e *engineModel, m *modelNode, n int) {
	t.Helper()
	for ; n > 0 && len(m.releases) > 0; n-- {
		id := m.releases[0].req
		m.releases = m.releases[1:]
		data, err := json.Marshal(messages.Released{Request: id, Epoch: c.epoch, Reason: messages.ReasonFinished})
		if err != nil {
			t.Fatal(err)
		}
		before := c.st.Releases
		c.onReleased(&nats.Msg{Data: data})
		if c.st.Releases > before {
			e.handedBack(t, id)
		}
		checkReuse(t, e, m, "after a release of "+id)
	}
}

// TestReannounceAfterPreemption checks the exact events a resync sends for
// requests preempted with a release still owed (PROTOCOL.md: preempted
// with no block tracked is released at once; finished of a preempted
// request forgets its block ids). No block the engine gets back with an
// owed release may be named after an earlier owed release's event.
func TestReannounceAfterPreemption(t *testing.T) {
	t.Parallel()
	start := func(c *Client) {
		c.Added("r", 8)
		c.Hashes("r", 0, []byte{0xaa})
		c.Blocks("r", 0, 0, []uint32{1, 2, 3})
		c.Tokens("r", 8, 8)
	}
	release := func(c *Client) {
		data, _ := json.Marshal(messages.Released{Request: "r", Epoch: c.epoch, Reason: messages.ReasonPreempted})
		c.onReleased(&nats.Msg{Data: data})
	}
	for _, tc := range []struct {
		name  string
		steps func(c *Client)
		owed  int
		want  []string
	}{
		{"preempted then finished, the preemption's release owed", func(c *Client) {
			c.Preempted("r")
			c.Finished("r", false, 8, 8)
		}, 2, []string{"added", "hashes@0", "blocks g0@0 [1 2 3]", "tokens 8/8", "preempted", "finished 8/8"}},
		{"preempted then finished, the preemption's release came", func(c *Client) {
			c.Preempted("r")
			c.Finished("r", false, 8, 8)
			release(c)
		}, 1, []string{"added", "hashes@0", "finished 8/8"}},
		{"preempted, released, then finished", func(c *Client) {
			c.Preempted("r")
			release(c)
			c.Finished("r", true, 0, 8)
		}, 1, []string{"added", "hashes@0", "finished 0/8"}},
		{"preempted, resumed with other blocks, finished", func(c *Client) {
			c.Preempted("r")
			c.Resumed("r")
			c.Blocks("r", 0, 0, []uint32{4, 5})
			c.Finished("r", false, 8, 8)
		}, 2, []string{"added", "hashes@0", "preempted", "resumed", "blocks g0@0 [4 5]", "finished 8/8"}},
		{"preempted twice, the first release came", func(c *Client) {
			c.Preempted("r")
			c.Resumed("r")
			c.Blocks("r", 0, 0, []uint32{4, 5})
			c.Preempted("r")
			release(c)
			// the first preemption forgot computed, as the node does: blocks
			// [4 5] were given no KV before the second
		}, 1, []string{"added", "hashes@0", "blocks g0@0 [4 5]", "tokens 0/8", "preempted"}},
		{"preempted, then tokens for blocks to come", func(c *Client) {
			c.Preempted("r")
			c.Tokens("r", 4, 8)
		}, 1, []string{"added", "hashes@0", "blocks g0@0 [1 2 3]", "tokens 8/8", "preempted", "tokens 4/8"}},
		// What the node ignores the mirror ignores (step 8): blocks while
		// preempted, tokens after finished, resumed of a running request.
		{"blocks while preempted are not mirrored", func(c *Client) {
			c.Preempted("r")
			c.Blocks("r", 0, 3, []uint32{7})
		}, 1, []string{"added", "hashes@0", "blocks g0@0 [1 2 3]", "tokens 8/8", "preempted"}},
		{"tokens after finished are not mirrored", func(c *Client) {
			c.Finished("r", false, 8, 8)
			c.Tokens("r", 4, 8)
		}, 1, []string{"added", "hashes@0", "blocks g0@0 [1 2 3]", "finished 8/8"}},
		{"resumed of a running request keeps its blocks", func(c *Client) {
			c.Resumed("r")
		}, 0, []string{"added", "hashes@0", "blocks g0@0 [1 2 3]", "tokens 8/8"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &Client{reqs: map[string]*mreq{}, groups: 1, st: Stats{Resyncs: map[string]int{}},
				cfg: Config{Log: slog.New(slog.NewTextHandler(io.Discard, nil))}, out: newDispatcher(nil, nil, nil), epoch: "e1"}
			defer c.out.close()
			start(c)
			tc.steps(c)
			require.Equal(t, tc.owed, c.reqs["r"].owed)
			var got []string
			for _, ev := range reannounced(t, c) {
				switch ev.Type {
				case messages.EvHashes:
					got = append(got, fmt.Sprintf("hashes@%d", ev.Start))
				case messages.EvBlocks:
					got = append(got, fmt.Sprintf("blocks g%d@%d %v", ev.Group, ev.Start, ev.IDs))
				case messages.EvTokens, messages.EvFinished:
					got = append(got, fmt.Sprintf("%s %d/%d", ev.Type, ev.Computed, ev.Total))
				default:
					got = append(got, ev.Type.String())
				}
			}
			require.Equal(t, tc.want, got)
		})
	}
}
