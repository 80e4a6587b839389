package engine

import "github.com/kvactors/kvactors/actors"

// endOnFailure is the engine actors' guardian strategy (Props sets it; the
// node spawns them from the root context). protoactor's default would
// restart a failed engine actor with fresh fields: its requests stopped
// and released at once, copies still in flight or queued behind the
// release, the failing batch's credit never returned, the epoch's seq
// forgotten. Instead every failure resumes the actor, which keeps its
// state, and wakes it (failed). The actor decides (Actor.failure): the
// first failure ends the engine as an unregister does (Actor.fail), later
// ones only count; it stops itself as a last resort (a failure inside fail,
// or too many), and even then releases each request only once its copies
// end (Actor.giveUp). The failure is logged by the strategy, not the
// actor: it may stop before its failed message comes (it ends at once on
// its next message, and with no request left it stops).
var endOnFailure = actors.ResumeOnPanic("engine actor failed; resumed to end its engine",
	func(any) any { return &failed{} })
