package engine

import (
	"fmt"
	"runtime/debug"

	"github.com/asynkron/protoactor-go/actor"
)

// endOnFailure is the engine actors' guardian strategy (Props sets it; the
// node spawns them from the root context; one guardian per actor system,
// since every value of it is equal). protoactor's default would
// restart a failed engine actor with fresh fields: its requests stopped
// and released at once, copies still in flight or queued behind the
// release, the failing batch's credit never returned, the epoch's seq
// forgotten. Instead every failure resumes the actor, which keeps its
// state, and wakes it (failed). The actor decides (Actor.failure): the
// first failure ends the engine as an unregister does (Actor.fail), later
// ones only count; it stops itself as a last resort (a failure inside fail,
// or too many), and even then releases each request only once its copies
// end (Actor.giveUp).
type endOnFailure struct{}

func (endOnFailure) HandleFailure(system *actor.ActorSystem, sup actor.Supervisor, child *actor.PID,
	rs *actor.RestartStatistics, reason, message any) {
	rs.Fail()
	// Logged here: the actor may stop before its failed message comes (it
	// ends at once on its next message, and with no request left it stops).
	// Both mailbox runs (inline on the poster, or on the actor's loop)
	// recover the panic in a deferred call and escalate it to this guardian
	// synchronously (a guardian process handles Failure in SendSystemMessage):
	// this is the panicking goroutine, its stack not yet unwound.
	system.Logger().Error("engine actor failed; resumed to end its engine", "actor", child.Id, "reason", reason,
		"message", fmt.Sprintf("%T", message), "failures", rs.FailureCount(), "stack", string(debug.Stack()))
	sup.ResumeChildren(child)
	system.Root.Send(child, &failed{})
}
