package bench

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"text/tabwriter"
	"time"
)

// Report is everything a run measured. Phases that did not run are nil.
type Report struct {
	Machine    Machine        `json:"machine"`
	Engines    int            `json:"engines"`
	Duration   string         `json:"duration_per_phase"`
	Quick      bool           `json:"quick"`
	Started    time.Time      `json:"started"`
	Throughput *Throughput    `json:"throughput,omitempty"`
	Latency    *Latency       `json:"latency,omitempty"`
	Copy       *Copy          `json:"copy,omitempty"`
	Scale      *Scale         `json:"scale,omitempty"`
	External   *External      `json:"external,omitempty"`
	Burst      *ExternalBurst `json:"external_burst,omitempty"`
	Goals      []Goal         `json:"goals"`
}

// Machine says where the numbers were taken.
type Machine struct {
	CPUs       int    `json:"cpus"`
	GOMAXPROCS int    `json:"gomaxprocs"`
	CPUModel   string `json:"cpu_model"`
	GoVersion  string `json:"go_version"`
	LoadAvg    string `json:"loadavg_at_start"`
	ShmDir     string `json:"shm_dir"`
	External   bool   `json:"external_nats"`
}

// Goal is one of issue 5's targets and whether this run met it.
type Goal struct {
	Name   string  `json:"name"`
	Target string  `json:"target"`
	Value  float64 `json:"value"`
	Unit   string  `json:"unit"`
	Pass   bool    `json:"pass"`
	// Judged is false at --quick size: its steps are too short and small
	// for the targets to mean anything, so Pass is shown but not a verdict.
	Judged bool `json:"judged"`
}

// notJudged is the result column of a goal a quick run does not judge.
const notJudged = "not judged at --quick size"

func machine(cfg Config) Machine {
	m := Machine{CPUs: runtime.NumCPU(), GOMAXPROCS: runtime.GOMAXPROCS(0), GoVersion: runtime.Version(),
		ShmDir: cfg.ShmDir, External: cfg.NATSURL != ""}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
		_ = f.Close()
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		m.LoadAvg = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	return m
}

// goals judges the run against issue 5's targets. Latency is judged on the
// client-side measure (publish → stored), the stricter one.
func (r *Report) goals() {
	if t := r.Throughput; t != nil {
		r.Goals = append(r.Goals,
			Goal{Name: "event throughput", Target: fmt.Sprintf(">= %d events/s", GoalEventsPerSec),
				Value: t.EventsPerSec, Unit: "events/s", Pass: t.EventsPerSec >= GoalEventsPerSec},
			Goal{Name: "throughput vs raw NATS+decode", Target: fmt.Sprintf(">= %.2f", GoalRawRatio),
				Value: t.Ratio, Unit: "ratio", Pass: t.Ratio >= GoalRawRatio})
	}
	if l := r.Latency; l != nil {
		for _, lvl := range l.Levels {
			if lvl.Fraction == 0.5 {
				r.Goals = append(r.Goals, Goal{Name: "p99 publish → stored at 50% load",
					Target: fmt.Sprintf("< %v", GoalP99), Value: lvl.ClientP99MS, Unit: "ms",
					Pass: lvl.Jobs > 0 && lvl.ClientP99MS < float64(GoalP99)/1e6})
			}
		}
	}
	r.externalGoals()
	r.burstGoals()
	if c := r.Copy; c != nil {
		for _, s := range c.Sizes {
			r.Goals = append(r.Goals, Goal{Name: "copy " + sizeLabel(s.BlockBytes) + " vs copy()",
				Target: fmt.Sprintf(">= %.2f", GoalCopyRatio), Value: s.Ratio, Unit: "ratio",
				Pass: s.Ratio >= GoalCopyRatio})
		}
	}
	for i := range r.Goals {
		r.Goals[i].Judged = !r.Quick
	}
}

// Passed reports whether every goal that was measured and judged was met.
func (r *Report) Passed() bool {
	for _, g := range r.Goals {
		if g.Judged && !g.Pass {
			return false
		}
	}
	return true
}

// WriteTable prints the report as aligned tables.
func (r *Report) WriteTable(out io.Writer) error {
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	m := r.Machine
	fmt.Fprintf(w, "machine\t%d CPUs (GOMAXPROCS %d), %s, %s, load %s\n", m.CPUs, m.GOMAXPROCS, m.CPUModel, m.GoVersion, m.LoadAvg)
	nats := "embedded NATS (in-process)"
	if m.External {
		nats = "external NATS"
	}
	fmt.Fprintf(w, "run\t%d engines, %s per phase, %s, shm in %s\n", r.Engines, r.Duration, nats, m.ShmDir)
	if t := r.Throughput; t != nil {
		fmt.Fprintf(w, "\nTHROUGHPUT\tevents/s\tevents/CPU-s\tevents\tbatches\tevents/batch\tseconds\tCPU-s\n")
		fmt.Fprintf(w, "node (NATS → decode → actors → applied)\t%.0f\t%.0f\t%d\t%d\t%.1f\t%.2f\t%.2f\n",
			t.EventsPerSec, t.EventsPerCPUSec, t.Events, t.Batches, t.EventsPerBatch, t.Seconds, t.CPUSeconds)
		fmt.Fprintf(w, "raw (NATS → DecodeBatch)\t%.0f\t%.0f\t%d\t%d\t%.1f\t%.2f\t%.2f\n",
			t.RawEventsPerSec, t.RawEventsPerCPUSec, t.RawEvents, t.RawBatches,
			float64(t.RawEvents)/float64(max(t.RawBatches, 1)), t.RawSeconds, t.RawCPUSeconds)
		fmt.Fprintf(w, "node / raw\t%.2f\t%.2f\t\t\t\t\t\n", t.Ratio, t.CPURatio)
		fmt.Fprintf(w, "stored %.0f chunks, deduplicated %.0f, rejected %.0f; %.0f bytes/event; CPU-s: this process's user+system time\n",
			t.ChunksStored, t.ChunksDeduped, t.Rejected, t.BytesPerEvent)
	}
	if l := r.Latency; l != nil {
		fmt.Fprintf(w, "\nLATENCY (ms)\tevents/s\tjobs\tclient p50\tp99\tp99.9\tnode p50\tp99\tp99.9\n")
		for _, v := range l.Levels {
			fmt.Fprintf(w, "%.0f%% of %.0f\t%.0f\t%d\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f\t%.3f\n", v.Fraction*100,
				l.SaturationEventsPerSec, v.AchievedPerSec, v.Jobs, v.ClientP50MS, v.ClientP99MS, v.ClientP999MS,
				v.NodeP50MS, v.NodeP99MS, v.NodeP999MS)
		}
		fmt.Fprintf(w, "client: publish of the batch that made a job ready → its stored message at the engine (≥ publish → copy start)\n")
		fmt.Fprintf(w, "node: kvactors_store_decision_seconds, batch taken off the node's subscription → copy start (bucket-interpolated)\n")
	}
	if c := r.Copy; c != nil {
		fmt.Fprintf(w, "\nCOPY (GB/s)\tjob\tjobs\tnode\t(all jobs)\tend to end\tcopy()\tnode/copy()\te2e/copy()\tjob p50 ms\n")
		for _, s := range c.Sizes {
			fmt.Fprintf(w, "%s blocks\t%s\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%.3f\n", sizeLabel(s.BlockBytes),
				sizeLabel(s.JobBytes), s.Jobs, s.NodeGBps, s.NodeTotalGBps, s.EndToEndGBps, s.PlainGBps, s.Ratio,
				s.EndToEndRatio, s.JobP50MS)
		}
		fmt.Fprintf(w, "median job; node: kv_offload_total_bytes / kv_offload_total_time (Attachment.Copy); end to end: publish → stored\n")
	}
	if s := r.Scale; s != nil {
		fmt.Fprintf(w, "\nSCALE\tlive requests\tevents/s\tevents/CPU-s\theap B/request\tRSS B/request\n")
		fmt.Fprintf(w, "base\t%d\t%.0f\t%.0f\t\t\n", s.Base, s.BaseEventsPerSec, s.BaseEventsPerCPUSec)
		fmt.Fprintf(w, "scaled\t%d\t%.0f\t%.0f\t%.0f\t%.0f\n", s.Requests, s.EventsPerSec, s.EventsPerCPUSec,
			s.HeapBytesPerRequest, s.RSSBytesPerRequest)
		fmt.Fprintf(w, "scaled / base\t\t%.2f\t%.2f\t\t\n", s.Ratio, s.CPURatio)
		fmt.Fprintf(w, "seeding took %.2f s; %.0f live at the end; rejected %.0f\n", s.SetupSeconds, s.LiveAtEnd, s.Rejected)
	}
	r.External.writeTable(w)
	r.Burst.writeTable(w)
	if len(r.Goals) > 0 {
		fmt.Fprintf(w, "\nGOAL\ttarget\tvalue\tresult\n")
		for _, g := range r.Goals {
			verdict := "PASS"
			switch {
			case !g.Judged:
				verdict = notJudged
			case !g.Pass:
				verdict = "FAIL"
			}
			fmt.Fprintf(w, "%s\t%s\t%.3g %s\t%s\n", g.Name, g.Target, g.Value, g.Unit, verdict)
		}
	}
	return w.Flush()
}
