{{/* Labels every object carries. */}}
{{- define "nftcni.labels" -}}
app.kubernetes.io/name: nftcni
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The install mode: installMode, else from istio-cni's `chained`. */}}
{{- define "nftcni.mode" -}}
{{- if .Values.installMode -}}
{{- .Values.installMode -}}
{{- else if .Values.chained -}}
chained
{{- else -}}
standalone
{{- end -}}
{{- end }}

{{- define "nftcni.image" -}}
{{- printf "%s/%s:%s" .Values.hub .Values.image (.Values.tag | default .Chart.AppVersion | toString) -}}
{{- end }}

{{/*
The agent's pods' k8s-app label, which is also the DaemonSet's selector:
istio-cni's own (istio-cni-node) with readiness.istiodLabel, for istiod's
untaint controller, else nftcni-node. A selector cannot change, so an
upgrade that would change it stops here with a message instead of the API
server's "field is immutable" (lookup sees nothing in helm template).
*/}}
{{- define "nftcni.appLabel" -}}
{{- $want := ternary "istio-cni-node" "nftcni-node" (.Values.readiness.istiodLabel | default false) -}}
{{- $ds := lookup "apps/v1" "DaemonSet" .Release.Namespace "nftcni-node" -}}
{{- if $ds -}}
{{- $have := index ($ds.spec.selector.matchLabels | default dict) "k8s-app" | default "" -}}
{{- if and $have (ne $have $want) -}}
{{- fail (printf "readiness.istiodLabel would change the nftcni-node DaemonSet's selector from k8s-app=%s to k8s-app=%s, and a selector cannot change: keep the installed value, or helm uninstall and install again" $have $want) -}}
{{- end -}}
{{- end -}}
k8s-app: {{ $want }}
{{- end }}
