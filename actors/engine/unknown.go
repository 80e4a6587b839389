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

// maxRefused is how many refused ids a generation of refusedIDs holds:
// the last maxRefused refused are always remembered.
const maxRefused = 4096

// refusedIDs are the ids whose added was refused for the limit, each with
// the epoch it was refused in and whether it stands preempted (a second
// preempted before resumed is ignored, PROTOCOL.md). Two generations:
// when the current fills, it becomes the previous one and the oldest
// generation is forgotten. Only in the epoch an id was refused in does a
// preempted of it count: a new epoch re-announces its live requests,
// refusing them again if the limit still holds.
type refusedIDs struct {
	cur, prev map[string]refusal
}

type refusal struct {
	epoch     string
	preempted bool
}

func (r *refusedIDs) refuse(id, epoch string) {
	if r.cur == nil || len(r.cur) >= maxRefused {
		r.prev, r.cur = r.cur, make(map[string]refusal)
	}
	delete(r.prev, id)
	r.cur[id] = refusal{epoch: epoch}
}

func (r *refusedIDs) forget(id string) {
	delete(r.cur, id)
	delete(r.prev, id)
}

func (r *refusedIDs) find(id string) (map[string]refusal, refusal, bool) {
	if f, ok := r.cur[id]; ok {
		return r.cur, f, true
	}
	f, ok := r.prev[id]
	return r.prev, f, ok
}

// preempt reports whether a preempted of id in epoch is owed a release:
// id was refused in epoch and stands not preempted.
func (r *refusedIDs) preempt(id, epoch string) bool {
	m, f, ok := r.find(id)
	if !ok || f.epoch != epoch || f.preempted {
		return false
	}
	f.preempted = true
	m[id] = f
	return true
}

// resume: a resumed of id in its epoch makes its next preempted owed.
func (r *refusedIDs) resume(id, epoch string) {
	if m, f, ok := r.find(id); ok && f.epoch == epoch {
		f.preempted = false
		m[id] = f
	}
}
