package engine

import (
	"sort"
	"time"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors/request"
)

// collectTimeout bounds a status gather: a busy or stuck request actor makes
// the answer partial, never late.
const collectTimeout = time.Second

// collector gathers one status answer from each request actor, then delivers
// the engine's Status and stops.
type collector struct {
	st      Status
	pids    []*actor.PID
	waiting int
	reply   chan<- Status
}

func collectorProps(st Status, pids []*actor.PID, reply chan<- Status) *actor.Props {
	return actor.PropsFromProducer(func() actor.Actor {
		return &collector{st: st, pids: pids, waiting: len(pids), reply: reply}
	})
}

func (k *collector) Receive(c actor.Context) {
	switch m := c.Message().(type) {
	case *actor.Started:
		for _, pid := range k.pids {
			c.Send(pid, &request.StatusQuery{ReplyTo: c.Self()})
		}
		c.SetReceiveTimeout(collectTimeout)
		k.maybeDone(c)
	case *request.Status:
		k.st.Requests = append(k.st.Requests, m.Snapshot)
		k.waiting--
		k.maybeDone(c)
	case *actor.ReceiveTimeout:
		k.st.Partial = true
		k.waiting = 0
		k.maybeDone(c)
	}
}

func (k *collector) maybeDone(c actor.Context) {
	if k.waiting > 0 || k.reply == nil {
		return
	}
	sort.Slice(k.st.Requests, func(i, j int) bool { return k.st.Requests[i].Request < k.st.Requests[j].Request })
	select {
	case k.reply <- k.st:
	default: // the asker gave up; never block
	}
	k.reply = nil
	c.Stop(c.Self())
}
