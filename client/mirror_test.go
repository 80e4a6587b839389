package client

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
)

// modelNode applies events as the protocol says, far enough to compare
// what two event streams leave behind: hashes, block ids, tokens, phase,
// and the releases it publishes (at once: it makes no copies).
type modelNode struct {
	reqs     map[string]*modelReq
	releases []string // request ids, in order
}

type modelReq struct {
	hashes    []string
	blocks    [][]messages.BlockID
	computed  int
	total     int
	preempted bool
}

func newModel() *modelNode { return &modelNode{reqs: map[string]*modelReq{}} }

func (m *modelNode) apply(ev messages.Event) {
	r := m.reqs[ev.Request]
	if r == nil && ev.Type != messages.EvAdded {
		if ev.Type == messages.EvFinished {
			m.releases = append(m.releases, ev.Request)
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
			r.blocks = make([][]messages.BlockID, 2)
			m.releases = append(m.releases, ev.Request)
		}
	case messages.EvResumed:
		if r.preempted {
			r.preempted = false
			r.blocks = make([][]messages.BlockID, 2)
		}
	case messages.EvFinished:
		delete(m.reqs, ev.Request)
		m.releases = append(m.releases, ev.Request)
	}
}

// FuzzMirrorResync drives a client's mirror and a model node with the same
// random events, delivers a random part of the model's releases, then
// resyncs into a fresh model node. It checks that the new epoch leaves the
// fresh node with what the old one had for every live request (hashes,
// block ids of a running request, tokens, phase) and that it publishes
// exactly the releases the engine still waits for, plus one absorbed
// silently for each preempted request that owed none.
func FuzzMirrorResync(f *testing.F) {
	for _, seed := range []string{"", "\x00\x01\x02\x03\x04\x05\x06", "\x04\x00\x05\x06\x03\x04\x00\x06",
		"\x00\x02\x03\x04\x00\x05\x02\x06\xff\xfe", "\x10\x21\x32\x43\x54\x65\x76\x87\x98\xa9\xba\xcb\xdc\xed"} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, prog []byte) {
		c := &Client{reqs: map[string]*mreq{}, groups: 2, st: Stats{Resyncs: map[string]int{}},
			cfg: Config{Log: slog.New(slog.NewTextHandler(io.Discard, nil)), MaxBatchBytes: 1 << 30},
			out: newDispatcher(nil, nil), epoch: "e1"}
		defer c.out.close()
		old := newModel()
		finished := map[string]bool{}
		next := 0
		ids := func(b byte) []uint32 { return []uint32{uint32(b%7) + 1, uint32(b%5) + 9} }
		for i := 0; i+1 < len(prog); i += 2 {
			op, arg := prog[i]%8, prog[i+1]
			req := fmt.Sprintf("r%d", int(arg)%max(next, 1))
			if finished[req] && op != 0 {
				continue // ids are not reused after finishing
			}
			c.batch.Reset()
			switch op {
			case 0:
				req = fmt.Sprintf("r%d", next)
				next++
				c.Added(req, 16)
			case 1:
				c.Hashes(req, int(arg%3), []byte{arg}, []byte{arg + 1})
			case 2:
				c.Blocks(req, int(arg%2), int(arg%3), ids(arg))
			case 3:
				c.Tokens(req, int(arg), 200)
			case 4:
				c.Preempted(req)
			case 5:
				c.Resumed(req)
			case 6:
				c.Finished(req, arg%2 == 0, int(arg), 200)
				finished[req] = true
			case 7:
				deliverReleases(t, c, old, int(arg%4))
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
		for _, r := range c.reqs {
			r.announce(&c.batch, func(int) {})
		}
		applyBatch(t, &c.batch, fresh)
		slices.Sort(want)
		got := slices.Clone(fresh.releases)
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
// published and not delivered yet, as NATS messages of the current epoch.
func deliverReleases(t *testing.T, c *Client, m *modelNode, n int) {
	t.Helper()
	for ; n > 0 && len(m.releases) > 0; n-- {
		id := m.releases[0]
		m.releases = m.releases[1:]
		data, err := json.Marshal(messages.Released{Request: id, Epoch: c.epoch, Reason: messages.ReasonFinished})
		if err != nil {
			t.Fatal(err)
		}
		c.onReleased(&nats.Msg{Data: data})
	}
}
