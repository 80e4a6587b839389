package sim_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sim"
)

// strictPeer stands in for kvactors and checks the simulated engine's side
// of the protocol: seq, no blocks while preempted, tokens never ahead of
// blocks, and above all that no block id is handed to a request while
// another one holds it. It releases finished and preempted requests a few
// batches late, as a node with copies in flight would.
type strictPeer struct {
	t       *testing.T
	nc      *nats.Conn
	prefix  string
	tpb     []int
	lag     uint64 // batches before a release
	epoch   string
	seq     uint64
	owner   []map[messages.BlockID]string // per group: block id → request holding it
	reqs    map[string]*peerReq
	due     []dueRelease
	errs    []string
	batches int
	touched []string // requests with a tokens event in the current batch
}

type peerReq struct {
	blocks    [][]messages.BlockID
	preempted bool
	hashes    int
	computed  int
}

type dueRelease struct {
	at      uint64
	request string
	reason  string
	blocks  [][]messages.BlockID
}

func (p *strictPeer) errorf(format string, a ...any) {
	if len(p.errs) < 20 {
		p.errs = append(p.errs, fmt.Sprintf(format, a...))
	}
}

func (p *strictPeer) onBatch(m *nats.Msg) {
	engine := strings.Split(m.Subject, ".")[1]
	b, bad, err := ingest.DecodeBatch(engine, m.Data, ingest.Limits{})
	if err != nil || len(bad) > 0 {
		p.errorf("batch does not decode: %v %v", err, bad)
		return
	}
	p.batches++
	if p.epoch == "" {
		p.epoch = b.Epoch
	}
	if b.Epoch != p.epoch || b.Seq != p.seq+1 {
		p.errorf("batch epoch %s seq %d after epoch %s seq %d", b.Epoch, b.Seq, p.epoch, p.seq)
	}
	p.seq = b.Seq
	p.touched = p.touched[:0]
	for i := range b.Events {
		p.apply(&b.Events[i])
	}
	// A resume announces its recompute point before its fresh blocks, so
	// tokens are checked against blocks once the whole batch is applied.
	for _, id := range p.touched {
		r := p.reqs[id]
		for g, tpb := range p.tpb {
			if !r.preempted && r.computed > len(r.blocks[g])*tpb {
				p.errorf("%s: %d tokens computed with %d blocks of group %d", id, r.computed, len(r.blocks[g]), g)
			}
		}
	}
	p.release(engine, p.seq)
}

// release publishes the releases due by seq, freeing the ids first: the
// engine may reuse them as soon as it reads the release.
func (p *strictPeer) release(engine string, seq uint64) {
	keep := p.due[:0]
	for _, d := range p.due {
		if d.at > seq {
			keep = append(keep, d)
			continue
		}
		for g, ids := range d.blocks {
			for _, id := range ids {
				if id != 0 {
					delete(p.owner[g], id)
				}
			}
		}
		data, _ := json.Marshal(messages.Released{Request: d.request, Reason: d.reason})
		_ = p.nc.Publish(p.prefix+"."+engine+".released", data)
	}
	p.due = keep
}

func (p *strictPeer) apply(ev *messages.Event) {
	r := p.reqs[ev.Request]
	if r == nil && ev.Type != messages.EvAdded {
		p.errorf("%s for unknown request %s", ev.Type, ev.Request)
		return
	}
	switch ev.Type {
	case messages.EvAdded:
		p.reqs[ev.Request] = &peerReq{blocks: make([][]messages.BlockID, len(p.tpb))}
	case messages.EvHashes:
		if ev.Start != r.hashes {
			p.errorf("%s: hashes from %d, %d known", ev.Request, ev.Start, r.hashes)
		}
		r.hashes = ev.Start + len(ev.Hashes)
	case messages.EvBlocks:
		if r.preempted {
			p.errorf("%s: blocks while preempted", ev.Request)
		}
		if ev.Start != len(r.blocks[ev.Group]) {
			p.errorf("%s: blocks of group %d from %d, %d known", ev.Request, ev.Group, ev.Start, len(r.blocks[ev.Group]))
		}
		for _, id := range ev.IDs {
			if id == 0 {
				continue
			}
			if o, held := p.owner[ev.Group][id]; held {
				p.errorf("%s: block %d of group %d handed out while %s holds it", ev.Request, id, ev.Group, o)
			}
			p.owner[ev.Group][id] = ev.Request
		}
		r.blocks[ev.Group] = append(r.blocks[ev.Group], ev.IDs...)
	case messages.EvTokens:
		if ev.Computed > ev.Total {
			p.errorf("%s: computed %d > total %d", ev.Request, ev.Computed, ev.Total)
		}
		r.computed = ev.Computed
		p.touched = append(p.touched, ev.Request)
	case messages.EvPreempted:
		r.preempted = true
		p.later(ev.Request, messages.ReasonPreempted, r)
	case messages.EvResumed:
		r.preempted = false
		r.blocks = make([][]messages.BlockID, len(p.tpb))
	case messages.EvFinished:
		reason := messages.ReasonFinished
		if ev.Aborted {
			reason = messages.ReasonAborted
		}
		p.later(ev.Request, reason, r)
	}
}

func (p *strictPeer) later(req, reason string, r *peerReq) {
	p.due = append(p.due, dueRelease{at: p.seq + p.lag, request: req, reason: reason, blocks: r.blocks})
	r.blocks = make([][]messages.BlockID, len(p.tpb))
}

func TestEngineKeepsTheProtocol(t *testing.T) {
	_, nc := testkit.NATS(t)
	cfg := smallConfig("strict", t.TempDir())
	cfg.NumGPUBlocks = 120 // heavy block pressure
	cfg.StallTimeout = 5 * time.Second
	peer := &strictPeer{t: t, nc: nc, prefix: cfg.Prefix, lag: 3, reqs: map[string]*peerReq{}}
	for _, g := range cfg.Groups {
		peer.tpb = append(peer.tpb, g.TokensPerBlock)
		peer.owner = append(peer.owner, map[messages.BlockID]string{})
	}
	events := testkit.Subscribe(t, nc, "kvactors.strict.events")
	requests := testkit.Subscribe(t, nc, "kvactors.strict.*") // register, lookup, load

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	type result struct {
		rep sim.Report
		err error
	}
	done := make(chan result, 1)
	enc := engineConn(t, nc, cfg.Engine)
	go func() {
		rep, err := sim.Run(ctx, enc, cfg)
		done <- result{rep, err}
	}()
	// The peer runs here, on the test goroutine: one message at a time. An
	// idle engine sends no batch, so a ticker releases whatever is still due
	// (a node would release once its copies finish).
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			peer.release("strict", peer.seq+peer.lag)
		case m := <-events:
			peer.onBatch(m)
		case m := <-requests:
			switch {
			case strings.HasSuffix(m.Subject, ".register"):
				_ = m.Respond([]byte(`{"ok":true}`))
			case strings.HasSuffix(m.Subject, ".lookup"):
				_ = m.Respond([]byte(`{"hit_tokens":0}`))
			case strings.HasSuffix(m.Subject, ".load"):
				_ = m.Respond([]byte(`{"error":"this peer stores nothing"}`))
			}
		case res := <-done:
			require.NoError(t, res.err)
			require.Empty(t, peer.errs)
			// Nothing was stored, so every ready chunk is missing: the
			// check must say so.
			require.Positive(t, res.rep.Missing)
			require.ErrorIs(t, res.rep.Err(), sim.ErrCheck)
			require.Zero(t, res.rep.MissingReleases+res.rep.DuplicateReleases)
			require.Positive(t, res.rep.PreemptedPressure, "the block pool is small enough to preempt")
			require.Equal(t, res.rep.Batches, peer.batches)
			return
		case <-ctx.Done():
			t.Fatal("timed out waiting for the engine to finish")
		}
	}
}
