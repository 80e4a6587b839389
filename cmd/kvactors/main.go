package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/kvactors/kvactors/internal/buildinfo"
)

const usage = `kvactors: out-of-engine KV-cache offload service

usage: kvactors <command> [flags]

commands:
  serve     run a node (embedded NATS unless --nats)
  demo      run a node and a simulated engine, print what happened, check every byte
  bench     measure event throughput, latency, copy bandwidth and scale
  bench-compare  bench --external in alternating pairs against two kvactors binaries (--a, --b)
  nodes     list the nodes of a cluster (node, boot, engines, pool and disk, last heartbeat)
  flags     print the serve flag table (Markdown, as in docs/CONFIG.md)
  nats-config  write a NATS server configuration isolating engines, and its secret files, under --out; print the configuration (docs/SECURITY.md)
  version   print the version, VCS revision and build time

Run 'kvactors <command> --help' for a command's flags.
Exit status: 0 success or --help; 1 runtime failure; 2 bad flag, argument,
variable, config file or value; 3 serve's fencing fail-stop; 130 demo,
bench or bench-compare interrupted; 128+signal (130, 143) stopped at once by
a second SIGINT or SIGTERM during the first's graceful stop.
`

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	switch cmd, args := args[0], args[1:]; cmd {
	case "serve":
		return runServe(args, stdout, stderr)
	case "demo":
		return runDemo(args, stdout, stderr)
	case "bench":
		return runBench(args, stdout, stderr)
	case "bench-compare":
		return runCompare(args, stdout, stderr)
	case "nodes":
		return runNodes(args, stdout, stderr)
	case "flags":
		return flagsTable(args, stdout, stderr)
	case "nats-config":
		return natsConfig(args, stdout, stderr)
	case "version", "--version", "-v":
		return printVersion(args, stdout, stderr)
	case "help", "--help", "-h":
		fmt.Fprint(stdout, usage)
		return exitOK
	default:
		fmt.Fprintf(stderr, "kvactors: unknown command %q (see kvactors --help)\n", cmd)
		return exitUsage
	}
}

func printVersion(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("version", flag.ContinueOnError)
	asJSON := fs.Bool("json", false, "print the build info as JSON")
	if code := parseExit("version", parseFlags(fs, args), fs, stdout, stderr); code >= 0 {
		return code
	}
	info := buildinfo.Read()
	if *asJSON {
		_ = json.NewEncoder(stdout).Encode(info)
		return exitOK
	}
	fmt.Fprintln(stdout, info)
	return exitOK
}
