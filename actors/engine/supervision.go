package engine

import (
	"fmt"

	"github.com/asynkron/protoactor-go/actor"
)

// endOnFailure is the engine actors' guardian strategy (Props sets it; the
// node spawns them from the root context; one guardian per actor system,
// since every value of it is equal). protoactor's default would
// restart a failed engine actor with fresh fields: its requests stopped
// and released at once, copies still in flight or queued behind the
// release, the failing batch's credit never returned, the epoch's seq
// forgotten. Instead the first failure resumes the actor, which keeps its
// state, and wakes it (failed): it ends the engine as an unregister
// does (Actor.fail). A failure while it ends (state too broken to reset)
// stops it: its requests are then released aborted as their actors stop,
// and Closed is closed all the same.
type endOnFailure struct{}

func (endOnFailure) HandleFailure(system *actor.ActorSystem, sup actor.Supervisor, child *actor.PID,
	rs *actor.RestartStatistics, reason, message any) {
	rs.Fail()
	if rs.FailureCount() > 1 {
		system.Logger().Error("engine actor failed again while ending; stopping it", "actor", child.Id,
			"reason", reason)
		sup.StopChildren(child)
		return
	}
	// Logged here: the actor may stop before its failed message comes (it
	// ends at once on its next message, and with no request left it stops).
	system.Logger().Error("engine actor failed; it ends its engine", "actor", child.Id, "reason", reason,
		"message", fmt.Sprintf("%T", message))
	sup.ResumeChildren(child)
	system.Root.Send(child, &failed{})
}
