// Command mesh-provisioner is the provisioner's seat on a NATS mesh: it tails the provisioner's buckets
// into a local projection and answers mesh-provisioner.provisioning from it (serve), asks the verb
// (query), and rebuilds, replays and exports the buckets' history.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"

	// One malloc arena for Pebble's blocks, set as the program loads (its doc says why).
	_ "github.com/novox/mesh-provisioner/internal/cheap/onearena"
)

// Version is set at build time with -ldflags "-X main.Version=...".
var Version = "0.1.0-dev"

func main() {
	ctx, cancel := context.WithCancel(context.Background())
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	var first atomic.Value // the first signal
	go func() {
		// The first signal drains and closes cleanly; a second one stops hard.
		sig := <-sigs
		first.Store(sig)
		cancel()
		<-sigs
		fmt.Fprintln(os.Stderr, "second signal: stopping now")
		os.Exit(130)
	}()
	m := NewMain(os.Stdout, os.Stderr)
	err := m.Run(ctx, os.Args[1:])
	cancel()
	if sig, ok := first.Load().(syscall.Signal); ok && errors.Is(err, context.Canceled) {
		// Stopped by the signal before it finished (serve, which drains, returns nil and exits 0): said
		// as such, with the shell's code for it, not as a failure of "context canceled".
		name := map[syscall.Signal]string{syscall.SIGINT: "SIGINT", syscall.SIGTERM: "SIGTERM"}[sig]
		fmt.Fprintf(os.Stderr, "mesh-provisioner: stopped by %s before it finished\n", name)
		os.Exit(128 + int(sig))
	}
	os.Exit(exitCode(err, os.Stderr))
}

// Exit codes scripts can trust.
const (
	exitOK      = 0
	exitFailure = 1 // the command ran and failed
	exitUsage   = 2 // the command line is wrong
	exitAnswer  = 3 // the verb answered with an error
	// exitIncomplete: the command did its work without some composed-<node> buckets it could not read
	// (incompleteError), which it names.
	exitIncomplete = 4
	// exitNoFDs: the state dir's store, or a store replay or export opened, could not go on for want
	// of a file descriptor (store.ErrNoFDs, onFatal); EX_OSERR of sysexits.h.
	exitNoFDs = 71
)

// onFatal is the store's OnFatal for serve and rebuild, and for the stores replay and export open
// (replay.SetOnFatal; they have no log: log is nil). Pebble meets a descriptor it cannot do
// without on a goroutine of its own, where nothing returns an error to main and where it would
// panic next: the error is said as main says one (and logged), and the process exits with its own
// code. The one os.Exit outside main: the state dir keeps every batch committed, as a kill would,
// and a command's temporary store is only a copy.
func onFatal(log *slog.Logger, stderr io.Writer) func(error) {
	return func(err error) {
		if log != nil {
			log.Error("stopping: out of file descriptors", "err", err)
		}
		fmt.Fprintln(stderr, "mesh-provisioner:", err)
		os.Exit(exitNoFDs)
	}
}

// incompleteError is a command that did its work but for some composed-<node> buckets whose streams
// it could not read (a permission missing for them, no leader, their consumer slot taken): what it
// wrote or answered lacks those nodes' compositions.
type incompleteError struct {
	did     string   // what was done, said first
	buckets []string // in byte order
	then    string   // what to do, said last
}

// incompleteShown is how many buckets an incompleteError names before it says how many more.
const incompleteShown = 20

func (e *incompleteError) Error() string {
	names := e.buckets
	more := ""
	if len(names) > incompleteShown {
		more = fmt.Sprintf(" and %d more", len(names)-incompleteShown)
		names = names[:incompleteShown]
	}
	msg := fmt.Sprintf("%s, incomplete: %d composed-<node> bucket(s) could not be read: %s%s", e.did, len(e.buckets), strings.Join(names, ", "), more)
	if e.then != "" {
		msg += "; " + e.then
	}
	return msg
}

// usageError is a wrong command line.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func exitCode(err error, stderr io.Writer) int {
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	fmt.Fprintln(stderr, "mesh-provisioner:", err)
	var ue *usageError
	var ve *verbError
	var ie *incompleteError
	switch {
	case errors.As(err, &ie):
		return exitIncomplete
	case errors.As(err, &ue):
		return exitUsage
	case errors.As(err, &ve):
		return exitAnswer
	}
	return exitFailure
}

// Main dispatches subcommands.
type Main struct {
	Stdout, Stderr io.Writer
}

// NewMain returns a Main writing to the given streams.
func NewMain(stdout, stderr io.Writer) *Main { return &Main{Stdout: stdout, Stderr: stderr} }

// Run runs the subcommand named by args[0].
func (m *Main) Run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		m.usage()
		return &usageError{msg: "no command given"}
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "serve":
		return (&ServeCommand{Stdout: m.Stdout, Stderr: m.Stderr}).Run(ctx, rest)
	case "query":
		return (&QueryCommand{Stdout: m.Stdout, Stderr: m.Stderr}).Run(ctx, rest)
	case "version", "--version", "-version":
		// --version too: the flag an operator types first, which was an unknown command.
		if len(rest) == 1 && (rest[0] == "-h" || rest[0] == "--help" || rest[0] == "-help") {
			// Like every other subcommand's --help: its usage, exit 0, not "takes no arguments".
			fmt.Fprintf(m.Stderr, `Usage: mesh-provisioner version

Prints the program's version on stdout and exits 0. It takes no flags and asks no server.

Example:
  mesh-provisioner version    # mesh-provisioner %s
`, Version)
			return nil
		}
		if len(rest) > 0 {
			return &usageError{msg: fmt.Sprintf("version takes no arguments, got %q", rest)}
		}
		fmt.Fprintln(m.Stdout, "mesh-provisioner", Version)
		return nil
	case "help", "-h", "--help":
		m.usage()
		return nil
	default:
		if extra, ok := extraCommands[cmd]; ok {
			return extra(ctx, m, rest)
		}
		m.usage()
		return &usageError{msg: fmt.Sprintf("unknown command %q", cmd)}
	}
}

// extraCommands are the subcommands registered by their own files (rebuild, replay, export).
var extraCommands = map[string]func(ctx context.Context, m *Main, args []string) error{}

func (m *Main) usage() {
	fmt.Fprint(m.Stderr, `mesh-provisioner: the provisioner's seat on a NATS mesh.

Usage:
  mesh-provisioner <command> [flags]

Commands:
  serve     tail the buckets into the projection under --state and answer mesh-provisioner.provisioning
  query     ask the verb and print a table (--json for scripts)
  rebuild   rebuild the state dir from scratch from the buckets' streams
  replay    forensics over the history: state as of a point, a key's history, what changed
  export    write the buckets' raw history to an archive file
  version   print the version

Run 'mesh-provisioner <command> --help' for a command's flags and an example.
`)
}
