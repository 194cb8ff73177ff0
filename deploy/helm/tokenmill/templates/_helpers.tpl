{{/* Names and labels shared by the templates. */}}
{{- define "tokenmill.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tokenmill.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tokenmill.engineSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: engine
{{- end -}}

{{- define "tokenmill.routerSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end -}}

{{- define "tokenmill.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* The served model name the metrics carry (model_name label). */}}
{{- define "tokenmill.servedName" -}}
{{- .Values.model.servedModelName | default "SmolLM2-135M-Instruct" -}}
{{- end -}}

{{- define "tokenmill.apiKeyEnv" -}}
{{- if .Values.apiKeySecret.name }}
- name: TOKENMILL_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeySecret.name }}
      key: {{ .Values.apiKeySecret.key }}
{{- end }}
{{- end -}}
