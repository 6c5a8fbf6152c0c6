package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"k8s.io/klog/v2"

	"github.com/xdproxy/xdproxy/control/agent"
	"github.com/xdproxy/xdproxy/control/config"
)

const usage = `usage:
  xdproxy run --config FILE [--node-name NAME] [--log-level LEVEL | -v]
        run the agent; NAME replaces the file's nodeName; LEVEL is debug,
        info (default), warn or error; -v is --log-level=debug
  xdproxy check --config FILE [--node-name NAME]
        validate a config file and exit
  xdproxy admin [--socket PATH] CMD
        ask a running agent; CMD is one of stats, services, conntrack,
        workers, interfaces, health, version, channels IFACE N (set the
        receive queues of a served interface, letting go of the queues
        that go away first: Linux refuses ethtool -L while they are held),
        or faults N (a testing aid: fail the next N publishes)
  xdproxy cleanup --config FILE
        remove what xdproxy keeps for its next start: pinned XDP programs
        (detaching them), state files, the exception link
  xdproxy mount-state-dir --config FILE [--node-name NAME]
        mount a tmpfs with huge pages at the config's stateDir, moving the
        files there into it, so that the connection table's state file gets
        huge pages; its own tmpfs or another file system already mounted
        there is left alone (run before xdproxy run, with none running;
        deploy/daemonset.yaml's init container)
  xdproxy version
`

// version is what `xdproxy version` prints: `make build` and `make image` set it
// to git describe's answer with -ldflags "-X main.version=$(VERSION)".
var version = "dev"

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "run":
		err = runCmd(os.Args[2:])
	case "check":
		_, _, err = loadConfig("check", os.Args[2:])
		if err == nil {
			fmt.Println("config ok")
		}
	case "admin":
		err = adminCmd(os.Args[2:])
	case "cleanup":
		err = cleanupCmd(os.Args[2:])
	case "mount-state-dir":
		err = mountStateDirCmd(os.Args[2:])
	case "version":
		fmt.Println("xdproxy", version)
	case "-h", "--help", "help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "xdproxy: unknown command %q\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "xdproxy:", err)
		os.Exit(1)
	}
}

// loadConfig parses the flags of run, check, cleanup and mount-state-dir
// and loads the config file they name, for this host.
func loadConfig(name string, args []string) (*config.Config, slog.Level, error) {
	fs := flag.NewFlagSet(name, flag.ExitOnError)
	path := fs.String("config", "", "path of the YAML config file")
	nodeName := fs.String("node-name", "", "this node's name, instead of the file's nodeName")
	levelName := fs.String("log-level", "info", "debug, info, warn or error")
	verbose := fs.Bool("v", false, "log at debug level")
	_ = fs.Parse(args)
	if *path == "" {
		return nil, 0, fmt.Errorf("%s: --config is required", name)
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*levelName)); err != nil {
		return nil, 0, fmt.Errorf("%s: --log-level %q: want debug, info, warn or error", name, *levelName)
	}
	if *verbose {
		level = slog.LevelDebug
	}
	c, err := config.LoadWith(*path, config.Options{NodeName: *nodeName})
	return c, level, err
}

func runCmd(args []string) error {
	cfg, level, err := loadConfig("run", args)
	if err != nil {
		return err
	}
	host, err := config.ThisHost()
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	slog.SetDefault(log)
	klog.SetSlogLogger(log) // client-go's informer logs into the same stream
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	return agent.Run(ctx, agent.Options{Config: cfg, Host: host, Version: version, Log: log})
}

func cleanupCmd(args []string) error {
	cfg, _, err := loadConfig("cleanup", args)
	if err != nil {
		return err
	}
	if err := agent.Cleanup(cfg); err != nil {
		return err
	}
	fmt.Println("cleaned up")
	return nil
}

func mountStateDirCmd(args []string) error {
	cfg, _, err := loadConfig("mount-state-dir", args)
	if err != nil {
		return err
	}
	what, err := agent.MountStateDir(cfg)
	if err != nil {
		return fmt.Errorf("mount-state-dir: %w", err)
	}
	fmt.Println(what)
	return nil
}

func adminCmd(args []string) error {
	fs := flag.NewFlagSet("admin", flag.ExitOnError)
	sock := fs.String("socket", config.DefaultAdminSocket, "admin socket of the running agent")
	_ = fs.Parse(args)
	method, path := "GET", ""
	switch what := fs.Arg(0); {
	case fs.NArg() == 1 && strings.Contains(" stats services conntrack workers interfaces health version ", " "+what+" "):
		path = "/" + what
	case what == "channels" && fs.NArg() == 3:
		method, path = "POST", fmt.Sprintf("/channels?interface=%s&queues=%s", fs.Arg(1), fs.Arg(2))
	case what == "faults" && fs.NArg() == 2:
		method, path = "POST", "/debug/faults?publish="+fs.Arg(1)
	default:
		return errors.New("admin: name one of stats, services, conntrack, workers, interfaces, health, version, channels IFACE N, faults N")
	}
	out, err := agent.AdminRequest(*sock, method, path)
	if err != nil {
		return fmt.Errorf("admin: %w", err)
	}
	_, err = os.Stdout.Write(out)
	return err
}
