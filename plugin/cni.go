package plugin

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"

	"github.com/tidwall/gjson"
)

// This file is the CNI calling convention: the verb and its arguments in
// the environment, the network config on stdin, the result or a CNI error
// on stdout. containernetworking/cni's skel does the same, but importing it
// (with the result types it brings) costs every exec of this binary page
// faults for package inits an ADD never uses, skel's compiled regexp among
// them: 1.15x a Go hello-world's exec with skel, against 1.1x without it,
// measured with nothing else linked (README, Benchmarks). The plugin runs
// for every pod sandbox, so it checks here what skel checks that matters
// to a chained plugin: the variables each verb needs, container IDs,
// interface and network names the runtime cannot have meant, and the
// cniVersion each verb requires. Its errors are the spec's error results,
// written here too: containernetworking/cni's types package links package
// net, whose inits cost every exec about 11 page faults.

// Error is a CNI error result: the spec's code, message and details.
type Error struct {
	Code    uint
	Msg     string
	Details string
}

// The spec's error codes the plugin returns.
const (
	ErrIncompatibleCNIVersion      uint = 1
	ErrInvalidEnvironmentVariables uint = 4
	ErrIOFailure                   uint = 5
	ErrDecodingFailure             uint = 6
	ErrInvalidNetworkConfig        uint = 7
	ErrTryAgainLater               uint = 11
	ErrPluginNotAvailable          uint = 50
	ErrInternal                    uint = 999
)

func newError(code uint, msg, details string) *Error {
	return &Error{Code: code, Msg: msg, Details: details}
}

// Error reads as libcni's Error does.
func (e *Error) Error() string {
	if e.Details == "" {
		return e.Msg
	}
	return e.Msg + "; " + e.Details
}

// appendJSON appends the error result for a config of cniVersion v.
func (e *Error) appendJSON(b []byte, v string) []byte {
	b = append(b, `{"cniVersion":`...)
	b = gjson.AppendJSONString(b, v)
	b = append(b, `,"code":`...)
	b = strconv.AppendUint(b, uint64(e.Code), 10)
	b = append(b, `,"msg":`...)
	b = gjson.AppendJSONString(b, e.Msg)
	if e.Details != "" {
		b = append(b, `,"details":`...)
		b = gjson.AppendJSONString(b, e.Details)
	}
	return append(b, "}\n"...)
}

// Args are one invocation's inputs.
type Args struct {
	Command     string
	ContainerID string
	Netns       string
	IfName      string
	Args        string // CNI_ARGS
	Path        string
	StdinData   []byte
}

// specVersion is the CNI spec this plugin implements; supportedVersions
// those it can run under as a chained plugin (prevResult appeared in 0.3.0).
const specVersion = "1.1.0"

// supportedVersions is in version order. Nothing here is computed at
// start-up: a package init runs in every exec.
var supportedVersions = [...]string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

// versionReply is VERSION's answer, written as it is: VERSION is the verb
// timed as the plugin's bare exec cost.
const versionReply = `{"cniVersion":"1.1.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]}` + "\n"

// requiredFor says whether env variable name is required for verb cmd.
func requiredFor(name, cmd string) bool {
	switch name {
	case "CNI_COMMAND", "CNI_PATH":
		return true
	case "CNI_CONTAINERID", "CNI_IFNAME":
		return cmd == "ADD" || cmd == "CHECK" || cmd == "DEL"
	case "CNI_NETNS":
		return cmd == "ADD" || cmd == "CHECK"
	}
	return false
}

// minVersion is the oldest config version verb cmd exists in.
func minVersion(cmd string) string {
	switch cmd {
	case "CHECK":
		return "0.4.0"
	case "GC", "STATUS":
		return "1.1.0"
	}
	return supportedVersions[0]
}

// Main runs one invocation and returns the process exit status.
func (p *Plugin) Main(getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) int {
	cmd := getenv("CNI_COMMAND")
	if cmd == "VERSION" {
		_, _ = io.WriteString(stdout, versionReply)
		return 0
	}
	if cmd == "" {
		fmt.Fprintf(stderr, "nftcni: the nftcni chained CNI plugin; CNI protocol versions supported: %s\n", strings.Join(supportedVersions[:], ", "))
		return 1
	}
	a, err := parseArgs(cmd, getenv, stdin)
	if err == nil {
		err = p.run(a, stdout)
	}
	if err == nil {
		return 0
	}
	var e *Error
	if !errors.As(err, &e) {
		e = newError(ErrInternal, err.Error(), "")
	}
	_, _ = stdout.Write(e.appendJSON(nil, specVersion))
	return 1
}

func (p *Plugin) run(a *Args, stdout io.Writer) error {
	switch a.Command {
	case "ADD":
		return p.Add(a, stdout)
	case "DEL":
		return p.Del(a)
	case "CHECK":
		return p.Check(a)
	case "GC":
		return p.GC(a)
	case "STATUS":
		return p.Status(a)
	}
	return newError(ErrInvalidEnvironmentVariables, "unknown CNI_COMMAND: "+a.Command, "")
}

// parseArgs reads the environment and stdin, and checks what skel checks.
func parseArgs(cmd string, getenv func(string) string, stdin io.Reader) (*Args, error) {
	a := &Args{Command: cmd, ContainerID: getenv("CNI_CONTAINERID"), Netns: getenv("CNI_NETNS"),
		IfName: getenv("CNI_IFNAME"), Args: getenv("CNI_ARGS"), Path: getenv("CNI_PATH")}
	var missing []string
	for _, name := range []string{"CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"} {
		if getenv(name) == "" && requiredFor(name, cmd) {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		return nil, newError(ErrInvalidEnvironmentVariables, fmt.Sprintf("required env variables [%s] missing", strings.Join(missing, ",")), "")
	}
	if requiredFor("CNI_CONTAINERID", cmd) && !validName(a.ContainerID) {
		return nil, newError(ErrInvalidEnvironmentVariables, "invalid characters in containerID", a.ContainerID)
	}
	if requiredFor("CNI_IFNAME", cmd) {
		if err := validIfName(a.IfName); err != nil {
			return nil, err
		}
	}
	var err error
	if a.StdinData, err = io.ReadAll(stdin); err != nil {
		return nil, newError(ErrIOFailure, fmt.Sprintf("error reading from stdin: %v", err), "")
	}
	root := gjson.ParseBytes(a.StdinData) // one pass for both fields (ValidBytes is another)
	if !gjson.ValidBytes(a.StdinData) || !root.IsObject() {
		return nil, newError(ErrDecodingFailure, "error unmarshall network config: not a JSON object", "")
	}
	name := root.Get("name").String()
	if name == "" {
		return nil, newError(ErrInvalidNetworkConfig, "missing network name", "")
	}
	if !validName(name) {
		return nil, newError(ErrInvalidNetworkConfig, "invalid characters found in network name", name)
	}
	v := root.Get("cniVersion").String()
	if v == "" {
		v = "0.1.0" // the spec's meaning of an absent cniVersion
	}
	if !slices.Contains(supportedVersions[:], v) {
		return nil, newError(ErrIncompatibleCNIVersion, "incompatible CNI versions",
			fmt.Sprintf("config is %q, plugin supports %v", v, supportedVersions[:]))
	}
	if slices.Index(supportedVersions[:], v) < slices.Index(supportedVersions[:], minVersion(cmd)) {
		return nil, newError(ErrIncompatibleCNIVersion, fmt.Sprintf("config version does not allow %s", cmd), "")
	}
	return a, nil
}

// validName is skel's rule for container IDs and network names:
// [a-zA-Z0-9][a-zA-Z0-9_.-]*.
func validName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || (c != '_' && c != '.' && c != '-')) {
			return false
		}
	}
	return true
}

// validIfName is the kernel's rule for interface names, as skel checks it.
func validIfName(s string) error {
	bad := func(why string) error {
		return newError(ErrInvalidEnvironmentVariables, "interface name "+why, s)
	}
	switch {
	case s == "":
		return bad("is empty")
	case len(s) > 15:
		return bad("is too long")
	case s == "." || s == "..":
		return bad(`is "." or ".."`)
	case strings.ContainsAny(s, "/: \t\n\v\f\r"):
		return bad("contains / or : or whitespace")
	}
	return nil
}
