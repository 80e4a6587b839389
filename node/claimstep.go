package node

import (
	"context"
	"time"

	"github.com/kvactors/kvactors/messages"
)

// A claimStep is work of one engine that waits on JetStream (a register's
// claim on a cluster, the release of a claim it could not use): run goes on
// a goroutine of its own, off the intake's shard worker, so a JetStream
// stall (a KV leader election) holds up that engine alone, not every engine
// hashed to its shard; then runs on the worker once run has returned, and
// returns the engine's next step, or nil when the message is done.
//
// Meanwhile the engine is parked on its shard (ingester.park): its messages
// taken later wait behind the step, in order, and are handled after it, so
// one engine's messages are still handled in the order the engine sent them.
type claimStep struct {
	run  func(halt context.Context) // off the worker; halt ends when the intake stops
	then func() *claimStep          // on the worker
}

// registerClaimed is a register on a cluster: the claim (claimRegister,
// under the engine id's claim lock) off the worker; then, on the worker,
// the register itself and its answer. A claim won for a spec this node
// cannot serve is given up off the worker too, before the refusal is
// answered (the engine may then register with another node at once).
func (n *Node) registerClaimed(ctx context.Context, id string, spec messages.EngineSpec, reply string,
	at time.Time) *claimStep {
	var unlock func()
	var serve bool
	return &claimStep{
		run: func(halt context.Context) {
			unlock = n.claimLock(id) // an ended engine's claim is not released under this register
			serve = n.claimRegister(ctx, halt, id, spec, reply)
		},
		then: func() *claimStep {
			if !serve {
				unlock()
				return nil
			}
			err := n.register(id, spec, at)
			refused := err != nil && n.engine(id) == nil
			unlock()
			if !refused {
				n.answerRegister(ctx, id, reply, err)
				return nil
			}
			return &claimStep{ // claimed for a spec this node cannot serve
				run:  func(context.Context) { n.releaseClaimIfGone(id) },
				then: func() *claimStep { n.answerRegister(ctx, id, reply, err); return nil },
			}
		},
	}
}

// shardWork is a shard worker's own state; no other goroutine touches it.
type shardWork struct {
	mk     *shardMarks
	parked map[string]*parkedEngine
	done   chan *parkedEngine // a step's run has returned
	out    int                // steps whose run has not yet been received on done
}

// parkedEngine is an engine whose step is out: held is the message that
// started it (a register), later the engine's messages taken since, in
// order. Their bytes stay counted in the intake budget until each is
// handled.
type parkedEngine struct {
	engine string
	held   inbound
	step   *claimStep
	later  []inbound
	bytes  int64 // later's
}

// work is shard i's worker. It ends once its queue is closed (stop) and
// every step it started has come back: a step outstanding at stop is
// waited for (stop halts it first), so no goroutine outlives the intake
// and no one sends on done after the worker is gone.
func (in *ingester) work(i int) {
	defer in.wg.Done()
	w := &shardWork{mk: &in.marks[i], parked: map[string]*parkedEngine{}, done: make(chan *parkedEngine)}
	q := in.queues[i]
	for q != nil || w.out > 0 {
		var x inbound
		ok := true
		if w.out == 0 {
			x, ok = <-q // no step out (always, off a cluster): the queue alone
		} else {
			select {
			case x, ok = <-q:
			case p := <-w.done:
				w.out--
				in.resume(w, p)
				continue
			}
		}
		if !ok {
			q = nil // closed: only steps still out are awaited (a nil channel never receives)
			continue
		}
		in.flushLost()
		in.next(w, x)
		w.mk.handled.Store(x.n) // its batch, if any, is in its actor's mailbox now, or parked (shardMarks.parked)
	}
}

// next handles x, or parks it behind its engine's step.
func (in *ingester) next(w *shardWork, x inbound) {
	if len(w.parked) > 0 {
		if p := w.parked[x.engine]; p != nil {
			in.queueBehind(p, x)
			return
		}
	}
	if lent, st := in.handle(&x); st != nil {
		in.park(w, &parkedEngine{engine: x.engine, held: x, step: st})
	} else if !lent {
		in.release(x.bucket, x.size)
	}
}

// queueBehind parks x behind its engine's step. An engine parked holds at
// most half the intake budget that way (the others keep the rest); past
// that, its message is dropped as on a full intake (overflow: a batch makes
// the engine resync, a request is answered with an error).
func (in *ingester) queueBehind(p *parkedEngine, x inbound) {
	if p.bytes+x.size > in.budget/2 {
		in.release(x.bucket, x.size)
		in.overflow(x.engine, x.verb, x.msg)
		return
	}
	p.later = append(p.later, x)
	p.bytes += x.size
}

// park starts p's step off the worker, its engine parked until it ends.
func (in *ingester) park(w *shardWork, p *parkedEngine) {
	w.parked[p.engine] = p
	w.mk.park(p.engine, true)
	in.launch(w, p)
}

func (in *ingester) launch(w *shardWork, p *parkedEngine) {
	w.out++
	st, halt := p.step, in.halt
	go func() {
		st.run(halt)
		w.done <- p // the worker receives until every step it started is back
	}()
}

// resume runs on the worker once p's step is back: its then, and, when the
// held message is done, the engine's parked messages in order, until one
// of them (another register) parks it again.
func (in *ingester) resume(w *shardWork, p *parkedEngine) {
	in.flushLost()
	if next := p.step.then(); next != nil {
		p.step = next
		in.launch(w, p)
		return
	}
	in.release(p.held.bucket, p.held.size)
	// The register may have routed the engine: a batch of it lost while it
	// was parked is told to its actor before the messages parked behind it.
	in.flushLost()
	for len(p.later) > 0 {
		x := p.later[0]
		p.later[0] = inbound{}
		p.later = p.later[1:]
		p.bytes -= x.size
		lent, st := in.handle(&x)
		if st != nil {
			p.held, p.step = x, st
			in.launch(w, p)
			return
		}
		if !lent {
			in.release(x.bucket, x.size)
		}
	}
	delete(w.parked, p.engine)
	w.mk.park(p.engine, false)
}

// park records that engine is (or is no longer) parked on the shard: the
// lease check (ingester.backlogged) counts its parked messages as a
// backlog. Only the worker writes; it marks an engine parked before it
// marks the message that parked it handled.
func (m *shardMarks) park(engine string, on bool) {
	m.parkMu.Lock()
	defer m.parkMu.Unlock()
	if !on {
		delete(m.parked, engine)
		return
	}
	if m.parked == nil {
		m.parked = map[string]bool{}
	}
	m.parked[engine] = true
}

func (m *shardMarks) isParked(engine string) bool {
	m.parkMu.Lock()
	defer m.parkMu.Unlock()
	return m.parked[engine]
}
