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
{{- printf "%s/%s:%s" .Values.hub .Values.image (.Values.tag | default .Chart.AppVersion) -}}
{{- end }}
