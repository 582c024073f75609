{{/* The labels every object of the chart carries. */}}
{{- define "vgpu.labels" -}}
app.kubernetes.io/name: vgpu-node-agent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The image, its tag defaulting to the chart's appVersion. */}}
{{- define "vgpu.image" -}}
{{- $repo := required "image.repository is not set: no vgpu image is published yet. Build packaging/image/Dockerfile (docs/deploying.md), push it to a registry your nodes pull from, and set image.repository (and image.tag)" .Values.image.repository -}}
{{ $repo }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Whether the agent speaks HAMi's or Volcano's scheduler protocol (pod and node annotations). */}}
{{- define "vgpu.annotates" -}}
{{- if or (eq .Values.compat "hami") (eq .Values.compat "volcano") }}true{{ end }}
{{- end }}

{{/* The probes' and Service's scheme. */}}
{{- define "vgpu.metricsScheme" -}}
{{- if .Values.metrics.tlsSecret }}HTTPS{{ else }}HTTP{{ end }}
{{- end }}
