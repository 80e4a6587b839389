package bench

import (
	"fmt"
	"io"
)

// Goals of issue 14, judged on the out-of-process run.
const (
	GoalExternalUSPerEvent = 2.5 // node CPU µs per event, store-heavy mix
	GoalExternalRawRatio   = 0.5 // events/s over raw NATS + decode, same run
)

func (r *Report) externalGoals() {
	e := r.External
	if e == nil {
		return
	}
	r.Goals = append(r.Goals,
		Goal{Name: "external: node CPU per event", Target: fmt.Sprintf("<= %.1f µs", GoalExternalUSPerEvent),
			Value: e.NodeUSPerEvent, Unit: "µs", Pass: e.Events > 0 && e.NodeUSPerEvent <= GoalExternalUSPerEvent},
		Goal{Name: "external: vs raw NATS+decode", Target: fmt.Sprintf(">= %.2f", GoalExternalRawRatio),
			Value: e.Ratio, Unit: "ratio", Pass: e.Ratio >= GoalExternalRawRatio})
}

// writeTable prints the out-of-process section (nothing when e is nil).
func (e *External) writeTable(w io.Writer) {
	if e == nil {
		return
	}
	fmt.Fprintf(w, "\nEXTERNAL (%s, child process)\tevents/s\tevents\tseconds\tnode CPU-s\tµs/event\tµs/stored chunk\tµs/store job\n", e.Workload)
	fmt.Fprintf(w, "node (NATS → … → last released)\t%.0f\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\n",
		e.EventsPerSec, e.Events, e.Seconds, e.NodeCPUSeconds, e.NodeUSPerEvent, e.NodeUSPerChunk, e.NodeUSPerJob)
	fmt.Fprintf(w, "node, nothing stored (no hashes)\t%.0f\t%d\t%.2f\t%.2f\t%.2f\t\t\n",
		float64(e.NoStoreEvents)/max(e.NoStoreSeconds, 1e-9), e.NoStoreEvents, e.NoStoreSeconds, e.NoStoreCPUSeconds, e.NoStoreUSPerEvent)
	fmt.Fprintf(w, "raw (child's NATS → DecodeBatch here)\t%.0f\t%d\t%.2f\t%.2f\t%.2f\t\t\n",
		e.RawEventsPerSec, e.RawEvents, e.RawSeconds, e.RawNodeCPUSeconds, e.RawNodeUSPerEvent)
	fmt.Fprintf(w, "node / raw\t%.2f\t\t\t\t\t\t\n", e.Ratio)
	fmt.Fprintf(w, "%d requests released (%.1f events/request), %d store jobs, %d chunks stored; node peak RSS %.0f MiB; bench CPU-s %.2f\n",
		e.Requests, e.EventsPerReq, e.StoreJobs, e.StoredChunks, float64(e.NodeMaxRSSBytes)/(1<<20), e.BenchCPUSeconds)
	fmt.Fprintf(w, "storing adds %.2f µs of node CPU per stored chunk (store-heavy CPU less its events at the nothing-stored cost)\n", e.StoreUSPerChunk)
	fmt.Fprintf(w, "node CPU-s: the child's user+system time (/proc/<pid>/stat); each µs/… divides all of it by one count\n")
}
