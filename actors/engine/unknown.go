package engine

import "github.com/kvactors/kvactors/messages"

// Events of requests this actor does not know (route): an added past
// --max-requests is refused, and the engine, which a batch gives no reply,
// goes on with the request; its finished is answered (PROTOCOL.md), and so
// is each preempted of it, since the engine waits for a release per
// preemption too. Any other event of an unknown request is rejected.

func (a *Actor) rejectUnknown(id string, ev *messages.Event) {
	a.deps.Metrics.Rejected.WithLabelValues(messages.RejectUnknownRequest).Inc()
	a.deps.Reject.Reject(messages.RejectUnknownRequest, "event rejected", "engine", a.deps.Engine, "request", id,
		"type", ev.Type.String(), "err", "unknown request")
}

// maxRefused bounds Actor.refused: past it the set starts over (a
// preempted of an id forgotten so is rejected, as before it was kept).
const maxRefused = 4096

// refuse notes that id's added was refused for the limit: its preempted
// events are answered (route).
func (a *Actor) refuse(id string) {
	if a.refused == nil || len(a.refused) >= maxRefused {
		a.refused = map[string]struct{}{}
	}
	a.refused[id] = struct{}{}
}
